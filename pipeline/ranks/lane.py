"""A lane: the batches in flight from one dataloader iterator, and where that iterator stands.

Batches are kept per dataloader iterator: calling `progress()` with another iterator (an eval
loader, say) parks the in-flight batches of the first one, and calling it again with the first
resumes them, so no batch is lost, repeated or run in the other loader's loop. A `Ticket` is what
the ranks' protocol records for one fetched batch.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from pipeline.ranks.status import Status
from pipeline.ranks.votes import Vote

__all__ = ["Lane", "LaneState", "Ticket"]


class LaneState(enum.Enum):
    """Where a lane's iterator stands; only `OPEN` and `EXHAUSTED` fetch."""

    OPEN = "open"
    """Batches are taken from the iterator."""
    EXHAUSTED = "exhausted"
    """This rank's iterator raised StopIteration; across ranks, placeholders (no batch) are added
    until every rank agrees that the data ended, since other ranks may still have batches."""
    DRAINING = "draining"
    """`drain()`: the batches in flight run, nothing is fetched."""
    ENDED = "ended"
    """Every rank agreed that the data ended: nothing more is fetched."""


@dataclass(slots=True, eq=False)
class Ticket:
    """What the ranks' protocol records for one batch this rank fetched (or a placeholder)."""

    position: int
    """Index of the batch in its dataloader (the same position on every rank)."""
    status: Status
    """This rank's status for the batch (written at fetch)."""
    vote: Vote | None = None
    """How many ranks have each status for this batch (started at fetch; None with one rank or
    `agreement=False`)."""
    carried: bool = False
    """No vote was started at fetch: the status rides on the batch's splits all-to-all (the
    input dist's `StatusSplits`), or, if the batch's first collective is another, is voted then."""
    found_keys: Any = None
    """The keys the batch has, when the key check failed."""
    problem: str | None = None
    """What is wrong with the batch's KeyedJaggedTensors, when that check failed."""
    admitted: bool = False
    """Every rank has the batch: it may enter collectives."""


@dataclass(eq=False)
class Lane:
    """The batches in flight from one dataloader iterator (contexts, oldest first)."""

    iterator: Iterator[Any]
    inflight: deque[Any] = field(default_factory=deque)
    state: LaneState = LaneState.OPEN
    fetched: int = 0
    """Batches taken from the iterator so far."""
    tickets: int = 0
    """Batches and placeholders fetched so far (the same count on every rank)."""
    steps: int = 0
    """Batches of this iterator run so far."""

    def drain(self) -> None:
        """Fetch nothing more; what is in flight still runs."""
        if self.state is not LaneState.ENDED:
            self.state = LaneState.DRAINING
