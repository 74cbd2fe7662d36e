"""`Ranks`: the one owner of the ranks' agreement on every batch, before it enters a collective.

Every rank has a status for every batch position it fetches (`Status`), recorded in the batch's
`Ticket`; every rank fetches in the same order, placeholders included. Each rank learns every
rank's status before the batch's first collective: in steady state on that collective itself, the
fused splits all-to-all (`carried` tickets, concluded at the splits wait: `pipeline.ranks.riding`),
otherwise by a vote started at fetch (`pipeline.ranks.votes`) and waited a step later (`admit`).

So uneven data ends on every rank at the shortest rank's count, a batch with wrong keys or a
malformed KeyedJaggedTensor stops every rank with the same error, and a rank that raises makes its
peers stop within seconds (`pipeline.ranks.failure`). A rank whose dataloader is exhausted keeps
adding placeholders (no batch) until the end is agreed, so every rank holds as many batches in
flight and issues the same collectives in order.

A checkpoint needs no drain: a dataloader's own `state_dict()` is ahead of the model, by the
batches in flight, so the pipeline captures it right before each fetch (`capture`, where the
iterator is a `StatefulIterator`, e.g. torchdata's `StatefulDataLoader`) and keeps it on the
batch's context; `resume_state` returns the one from before the oldest batch still in flight
(docs/pipeline.md, "Checkpointing").
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist

from pipeline.config import RankOptions
from pipeline.ranks.failure import FailureSignal
from pipeline.ranks.kjt_check import KeyCheck, KJTCheck
from pipeline.ranks.lane import Lane, LaneState, Ticket
from pipeline.ranks.status import (
    BatchKeysError,
    MalformedBatchError,
    RewriteMismatchError,
    Status,
    UnevenDataError,
    keys_message,
    malformed_message,
    uneven_message,
    warn_untrained,
)
from pipeline.ranks.votes import Vote, Votes

__all__ = ["Ranks", "StatefulIterator", "capture", "resume_state"]

_PIPELINE_IDS = itertools.count()
"""Numbers pipelines in construction order, the same on every rank (names the store keys)."""
_GROUP_IDS = itertools.count()
"""Numbers the process groups the pipelines create, in order (the same order on every rank)."""


class Ranks:
    """Fetch, admission and failure across ranks, for one pipeline.

    Args:
        options: how the ranks agree (`RankOptions`).
        model: the model trained (its embedding tables bound the ids `check_kjts` accepts).
        next_batch: takes the next batch from an iterator, None at its end (a pipeline's
            `_next_batch`, which a subclass may override); by default `next(iterator, None)`.
    """

    def __init__(
        self,
        options: RankOptions,
        *,
        model: torch.nn.Module | None = None,
        next_batch: Callable[[Any], Any] | None = None,
    ) -> None:
        self._options = options
        self._next_batch: Callable[[Any], Any] = next_batch or _next_or_none
        self.keys = KeyCheck() if options.check_keys else None
        self.kjts = KJTCheck(model) if options.check_kjts else None
        self._votes = Votes(timeout=options.peer_timeout, new_group=self.new_group)
        self.voting = options.agreement and self._votes.distributed
        """Ranks agree on every batch (else a rank's own status is all it knows)."""
        self._pipeline_id = next(_PIPELINE_IDS)  # the same on every rank: pipelines are built in step
        self._failure = FailureSignal(grace=options.failure_grace, scope=f"p{self._pipeline_id}/")
        self.lane: Lane | None = None
        """The lane whose step runs now (set by `PipelineCore._enter` at each step), None before the first."""
        self.untrained_batches: list[Any] = []
        """Batches this rank fetched but did not train because another rank's data ended first."""
        self._pending: list[Vote] = []
        """Votes started since the last `settle_votes`."""
        self.votes = 0
        """Votes started (one per batch fetched, placeholders included, while `voting`, unless
        the batch's status rides on its splits all-to-all)."""
        self.carried = 0
        """Batches fetched whose status rides on their splits all-to-all instead of a vote (a batch
        counts in `votes` or here, never both)."""
        self.carrying = False
        """Set by the input dist while a batch's status can ride on its fused splits all-to-all:
        batches fetched meanwhile start no vote (`Ticket.carried`). Changed only at points every
        rank reaches in the same order."""

    def new_group(self, **kwargs: Any) -> dist.ProcessGroup:
        """`dist.new_group(**kwargs)`, entered only once every rank reached it.

        Every rank must create the pipeline's process groups at the same point, but a rank whose
        dataloader raised never gets there, and `dist.new_group` would wait for it for the store's
        timeout (300 s). A rendezvous in the store first, which stops at a peer's failure
        (`FailureSignal.rendezvous`), keeps that wait to a few milliseconds.

        Raises:
            PeerFailedError: a peer failed before reaching it (or none came within `peer_timeout`).
        """
        timeout = self._options.peer_timeout.total_seconds()
        self._failure.rendezvous(f"group{next(_GROUP_IDS)}", timeout)
        return dist.new_group(**kwargs)

    def open_lane(self, iterator: Any) -> Lane:
        """A new lane for `iterator` (lanes are opened by lockstep `progress()` calls)."""
        return Lane(iterator)

    def fetch(self, lane: Lane) -> tuple[Any, Ticket] | None:
        """Take the next batch of `lane` and publish this rank's status for it.

        Returns:
            `(batch, ticket)`, with batch None for a placeholder (this rank's data ended, the
            others' may not have); None when nothing is to be added.
        """
        batch, status = None, Status.EXHAUSTED
        if lane.state is LaneState.OPEN:
            try:
                batch = self._next_batch(lane.iterator)
            except StopIteration:  # an override of `_next_batch` that calls next() itself
                batch = None
            if batch is None:
                lane.state = LaneState.EXHAUSTED
            else:
                status = Status.HAVE
        elif lane.state is not LaneState.EXHAUSTED:  # draining or ended: nothing is fetched
            return None
        if status == Status.EXHAUSTED and not self.voting:
            return None
        ticket = Ticket(position=lane.fetched, status=status)
        if status == Status.HAVE:
            lane.fetched += 1
            if self.keys is not None and (found := self.keys.check(batch)) is not None:
                ticket.status, ticket.found_keys = Status.BAD_KEYS, found
            elif self.kjts is not None and (problem := self.kjts.check(batch)) is not None:
                ticket.status, ticket.problem = Status.MALFORMED, problem
        lane.tickets += 1
        if self.voting and self.carrying and lane.tickets > 1:  # a dataloader's first is voted on,
            ticket.carried = True  # so that `peer_timeout` bounds the wait for a peer that stopped
            self.carried += 1
        elif self.voting:  # every rank fetches in the same order, so the votes pair up
            self._vote(ticket)
        return batch, ticket

    def _vote(self, ticket: Ticket) -> None:
        ticket.vote = self._votes.vote(ticket.status)
        self._pending.append(ticket.vote)
        self.votes += 1

    def admit(self, lane: Lane, ctx: Any) -> bool:
        """Learn every rank's status for `ctx`'s batch; call before its first collective.

        Returns:
            True: every rank has it. False: some rank's data ended there; `ctx` and everything
            after it are dropped from the lane on every rank, and the lane is ENDED.

        Raises:
            BatchKeysError: some rank's batch has the wrong keys (on every rank).
            MalformedBatchError: some rank's batch has a malformed KeyedJaggedTensor (on every rank).
            UnevenDataError: the data ended unevenly and `on_uneven="error"` (on every rank).
        """
        ticket: Ticket = ctx.ticket
        if ticket.admitted:
            return True
        if ticket.carried and ticket.vote is None:  # its first collective is not its splits: vote now
            self._vote(ticket)
            self.carried -= 1
        counts = ticket.vote.wait() if ticket.vote is not None else {ticket.status: 1}
        return self.conclude(lane, ctx, counts)

    def conclude(self, lane: Lane, ctx: Any, counts: dict[Status, int]) -> bool:
        """`admit` once every rank's status is known (`counts`: how many ranks have each; a batch
        whose status rode and every rank has is admitted by `Admission.conclude` alone)."""
        ticket: Ticket = ctx.ticket
        world = sum(counts.values())
        if counts.get(Status.HAVE, 0) == world:
            ticket.admitted = True
            return True
        if counts.get(Status.BAD_KEYS, 0) or counts.get(Status.MALFORMED, 0):
            mine = (self._failure.rank, ticket.position, ticket.found_keys, ticket.problem)
            details = self._votes.gather(mine) if self.voting else [mine]
            if counts.get(Status.BAD_KEYS, 0):
                raise BatchKeysError(keys_message(details, self.keys.expected if self.keys else None))
            raise MalformedBatchError(malformed_message(details))
        dropped = list(lane.inflight)[lane.inflight.index(ctx) :]
        for _ in dropped:
            lane.inflight.pop()
        lane.state = LaneState.ENDED
        if counts.get(Status.EXHAUSTED, 0) == world:
            return False  # every rank ended here: even data
        statuses = self._votes.gather(ticket.status) if self.voting else [ticket.status]
        if self._options.on_uneven == "error":
            raise UnevenDataError(uneven_message(statuses, ticket.position))
        untrained = [c.batch for c in dropped if c.ticket.status != Status.EXHAUSTED]
        if untrained:
            self.untrained_batches.extend(untrained)
            warn_untrained(self._failure.rank, len(untrained), statuses, ticket.position)
        return False

    def settle_votes(self) -> None:
        """Wait for every vote started so far (they have normally arrived: each was started a step
        earlier or during this one), so that none is in flight between two `progress()` calls, where
        the caller may destroy the process groups. A vote that cannot complete (the groups are
        gone after a failure) is dropped."""
        pending, self._pending = self._pending, []
        for vote in pending:
            with contextlib.suppress(Exception):
                vote.wait()

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (a blocking exchange, once, where every rank reaches it
        by construction; on the ranks' own group, which does not wait for a peer that failed)."""
        return self._votes.gather(obj)

    def agree_on(self, what: str, text: str, advice: str | None = None) -> None:
        """Check that every rank has the same `text` (once, before a collective that depends on it).
        `advice`: what to do where they differ (by default, about the sharded modules' calls).

        Raises:
            RewriteMismatchError: on every rank, naming the ranks whose `text` differs.
        """
        if not self.voting:
            return
        texts = self._votes.gather(text)
        if len(set(texts)) > 1:
            shown = "\n".join(f"  rank {r}:\n    " + t.replace("\n", "\n    ") for r, t in enumerate(texts))
            advice = advice or (
                "Make the model's calls of its sharded modules the same on every rank "
                "(no branch on batch data before them), or give explicit arg_paths."
            )
            raise RewriteMismatchError(
                f"the ranks found different {what}, so their collectives would not match:\n{shown}\n{advice}"
            )

    def fail(self, error: BaseException, reset: Callable[[], None]) -> None:
        """This rank raised inside `progress()`: `reset()` the batches in flight and, across ranks,
        make sure no peer is left waiting (`abort_on_error`: `FailureSignal.fail`).

        Raises:
            PeerFailedError: the error came from a peer's failure (a collective broken by it).
        """
        if self._options.abort_on_error:
            self._failure.fail(error, reset)
        else:
            reset()


class StatefulIterator(Protocol):
    """An iterator whose `state_dict()` says where its next item comes from.

    `state_dict()` must return a snapshot (later `next()` calls must not change it): the pipeline
    keeps one per batch in flight.
    """

    def __next__(self) -> Any: ...

    def state_dict(self) -> Any: ...


def capture(iterator: Iterator[Any]) -> Any:
    """The state of `iterator` before its next item is fetched; None if it keeps no state."""
    state_dict = getattr(iterator, "state_dict", None)
    return state_dict() if state_dict is not None else None


def resume_state(iterator: Iterator[Any], inflight: Iterable[Any]) -> Any:
    """The state to restore `iterator` to so that it yields the oldest untrained batch next.

    Args:
        iterator: the dataloader iterator given to `progress()`.
        inflight: the contexts of its batches in flight, oldest first (each with `loader_state`).

    Raises:
        TypeError: `iterator` has no `state_dict()`: call `pipe.drain(iterator)` before saving
            instead, then save the iterator's position by your own means.
    """
    if getattr(iterator, "state_dict", None) is None:
        raise TypeError(
            f"{type(iterator).__name__} has no state_dict(), so the pipeline cannot say where its "
            "oldest untrained batch came from: use a stateful dataloader (torchdata's "
            "StatefulDataLoader) or call pipe.drain(iterator) on every rank before saving"
        )
    for ctx in inflight:
        return ctx.loader_state  # the oldest: fetched after every batch that has been trained
    return iterator.state_dict()


def _next_or_none(iterator: Any) -> Any:
    return next(iterator, None)
