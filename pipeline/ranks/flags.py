"""Store flags: statuses other than `HAVE`, published in the default process group's store.

A rank whose status for a batch is not `HAVE` writes it into the store when it fetches the batch;
every rank reads one counter from the store (one round trip, 15 us idle, 100-300 us on two busy
cores) and the details only when the counter moved. When a read is valid, and so when it may start
in the background, is `pipeline.ranks.Ranks.world_collective_completed`'s to say.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch.distributed as dist

from pipeline.ranks.background import in_background
from pipeline.ranks.status import Status

__all__ = ["StoreFlags"]


class StoreFlags:
    """Statuses other than `HAVE`, published in the default process group's store under `prefix`
    (unique per pipeline and lane, the same on every rank).

    Reading the flags for a batch costs one round trip to the store's host (rank 0), 80-180 us on
    two busy cores. `read_in_background` starts that round trip on a background thread, so that it overlaps
    the step and `statuses` finds the answer there.
    """

    def __init__(self, store: Any, prefix: str) -> None:
        self.store, self._prefix = store, prefix
        self._events = f"{prefix}/events"
        self._seen = 0
        self._flags: dict[int, tuple[int, int]] = {}
        self._ahead: tuple[int, Future] | None = None
        """The latest background read: the sequence numbers it serves (up to), its future."""
        self.end_raised = False
        """This rank published that its data ended (an EXHAUSTED flag holds for every later batch)."""

    def raise_flag(self, status: Status, position: int) -> None:
        """Publish this rank's `status` for batch `position` (EXHAUSTED: from there on)."""
        rank = dist.get_rank()
        self.store.set(f"{self._prefix}/r{rank}", f"{int(status)} {position}")
        self.store.add(self._events, 1)  # after the set: a reader that sees it sees both
        self.end_raised = self.end_raised or status == Status.EXHAUSTED

    def read_in_background(self, through: int) -> None:
        """Start reading the flags' counter in the background; the read serves the batches of
        sequence numbers up to `through`. Valid only where `Ranks.world_collective_completed`
        says so."""
        self._ahead = (through, in_background(lambda: self.store.add(self._events, 0)))

    def statuses(self, position: int, world: int, seq: int | None = None) -> list[Status]:
        """Every rank's status for batch `position`, from the flags raised so far: the counter
        read in the background if that read serves sequence number `seq`, else read now."""
        ahead = self._ahead
        if ahead is not None and seq is not None and seq <= ahead[0]:
            events = ahead[1].result()
        else:
            events = self.store.add(self._events, 0)
        if events != self._seen:
            self._seen = events
            for rank in range(world):
                key = f"{self._prefix}/r{rank}"
                if self.store.check([key]):
                    status, at = map(int, self.store.get(key).split())
                    self._flags[rank] = (status, at)
        out = [Status.HAVE] * world
        for rank, (status, at) in self._flags.items():
            if (status == Status.EXHAUSTED and at <= position) or at == position:
                out[rank] = Status(status)
        return out
