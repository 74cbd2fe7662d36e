"""Votes: every rank's status for one batch, by one asynchronous all_reduce.

A vote is a `[world_size]` int64 tensor in which each rank fills its own slot, summed on a gloo group
of the pipeline's own. It is issued when the batch is fetched and waited before the batch's first
collective. On two shared cores its threads cost about a millisecond a step, so the protocol
(`pipeline.ranks.protocol`) votes only where nothing else orders the ranks, and uses store flags
(`pipeline.ranks.flags`) for every other batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipeline.ranks.failure import rank_and_world
from pipeline.ranks.status import Status

__all__ = ["Vote", "Votes"]


@dataclass(eq=False)
class Vote:
    """One batch's vote: `wait()` returns every rank's status for it, by rank."""

    work: Any
    tensor: torch.Tensor
    statuses: list[Status] | None = None

    def wait(self) -> list[Status]:
        if self.statuses is None:
            if self.work is not None:
                self.work.wait()
            self.statuses = [Status(int(v)) for v in self.tensor.tolist()]
        return self.statuses


class Votes:
    """Issues the votes on a gloo group of its own (created on first use, at the same call on every
    rank), or locally when there is no process group of more than one rank.

    Args:
        timeout: how long a vote may wait for a peer before failing (a peer that hangs).
        new_group: creates the group (`dist.new_group`'s keywords; `Ranks.new_group`, which does
            not wait for a peer that failed).
    """

    def __init__(self, *, timeout: timedelta, new_group: Callable[..., Any] = dist.new_group) -> None:
        self._timeout = timeout
        self._new_group = new_group
        self._group: Any = None

    @property
    def distributed(self) -> bool:
        return rank_and_world()[1] > 1

    def vote(self, status: Status) -> Vote:
        """Start this rank's vote for the next batch; every rank calls it once per batch, in order."""
        rank, world = rank_and_world()
        if world == 1:
            return Vote(None, torch.tensor([int(status)]))
        if self._group is None:
            self._group = self._new_group(backend="gloo", timeout=self._timeout)
        tensor = torch.zeros(world, dtype=torch.int64)
        tensor[rank] = int(status)
        return Vote(dist.all_reduce(tensor, group=self._group, async_op=True), tensor)

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (a rare, blocking exchange: only on the error paths, which every rank
        enters at the same vote)."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj, group=self._group)
        return out
