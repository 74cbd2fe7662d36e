"""Votes: how many ranks have each `Status` for one batch, by one small asynchronous all_reduce.

A vote is one int64 holding a 16-bit count per status; each rank puts 1 in its own status's field
and the ranks sum it on a gloo group of the pipeline's own (fields do not carry into each other
below 65,536 ranks). Its size does not grow with the world, and one element is gloo's cheapest
all_reduce (on two shared cores, a 4-element one cost three times the CPU). It is issued when the
batch is fetched and waited before the batch's first collective, a step later, so the wait finds it
done. Which rank had which status is only asked for on the rare paths that report it (`gather`).
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

_BITS = 16
"""Bits of one status's count in the vote's int64."""
_MAX_WORLD = (1 << (_BITS - 1)) - 1
"""The top field must not reach the sign bit."""


@dataclass(eq=False)
class Vote:
    """One batch's vote: `wait()` returns, per `Status`, how many ranks have it."""

    work: Any
    tensor: torch.Tensor
    counts: dict[Status, int] | None = None

    def wait(self) -> dict[Status, int]:
        if self.counts is None:
            if self.work is not None:
                self.work.wait()
            packed = int(self.tensor.item())
            mask = (1 << _BITS) - 1
            self.counts = {s: (packed >> (_BITS * i)) & mask for i, s in enumerate(Status)}
        return self.counts


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
        tensor = torch.tensor([1 << (_BITS * list(Status).index(status))], dtype=torch.int64)
        if not self.distributed:
            return Vote(None, tensor)
        if rank_and_world()[1] > _MAX_WORLD:
            raise RuntimeError(f"the ranks' vote counts up to {_MAX_WORLD} ranks; use agreement=False")
        return Vote(dist.all_reduce(tensor, group=self._own_group(), async_op=True), tensor)

    def _own_group(self) -> Any:
        if self._group is None:
            self._group = self._new_group(backend="gloo", timeout=self._timeout)
        return self._group

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (a rare, blocking exchange: only on the paths that report a batch
        some rank lacks or rejects, which every rank enters at the same vote)."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj, group=self._own_group())
        return out
