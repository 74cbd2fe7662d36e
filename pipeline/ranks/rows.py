"""The status row on the fused splits all-to-all: how a rank's word (`pipeline.ranks.word`) rides
on the collective every rank issues for a batch anyway, and how a rank without the batch sends the
same shape.

`StatusSplits` is torchrec's fused splits awaitable (`FusedKJTListSplitsAwaitable`) with one row
more, built through `rewrite.fuse_splits_requests(carrier=...)`; `StatusOnly` is what a rank without
the batch sends in its place, in the shape recorded from an earlier batch (`splits_shape`). Both
edit or mirror torchrec's private fields (`_awaitables`, `_lengths`, `_splits_awaitable`), so
`riding_fits` checks, before statuses ride, that the installed torchrec has them and that every
input dist is one this code knows to issue nothing but its splits and values all-to-alls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torchrec.distributed.dist_data import KJTAllToAll, SplitsAllToAllAwaitable
from torchrec.distributed.embedding_sharding import FusedKJTListSplitsAwaitable, KJTSplitsAllToAllMeta

__all__ = ["StatusOnly", "StatusSplits", "riding_fits", "settle_splits", "splits_shape"]


class _Rows:
    """A splits all-to-all whose row `status_row` is every rank's word: `wait()` gives every row
    (once waited, kept: the words are read before the splits)."""

    def __init__(self, inner: Any, status_row: int) -> None:
        self._inner, self._status_row, self._rows = inner, status_row, None

    def wait(self) -> list[list[int]]:
        if self._rows is None:
            self._rows = self._inner.wait()
        return self._rows

    def words(self) -> list[int]:
        """Per rank, what it sent at this rank's status row (a word if the ranks sent alike)."""
        rows = self.wait()
        if self._status_row >= len(rows):
            return []  # fewer rows than this rank sent: the receiver reports the mismatch
        return rows[self._status_row]


class StatusSplits(FusedKJTListSplitsAwaitable):
    """torchrec's fused splits all-to-all with one row more: this rank's word for the batch
    (`word(rows)`, from the number of splits rows before it), which every rank receives (`words()`,
    one per rank) before the values all-to-alls, which `wait()` starts, are issued. The row rides on
    the last module's splits while the all-to-all is built and is left out when the splits are read.

    Raises:
        RuntimeError: torchrec's fused awaitable is not of the shape this class edits (a torchrec
            release that changed it; `riding_fits` checks for that first).
    """

    def __init__(self, requests: list[Any], contexts: list[Any], pg: Any, word: Callable[[int], int]) -> None:
        metas = [a for r in requests for a in r.awaitables if isinstance(a, KJTSplitsAllToAllMeta)]
        last = metas[-1]
        self.rows = sum(len(m.splits_tensors) for m in metas)
        """The splits rows this rank sends before its word (its word's row index)."""
        last.splits_tensors.append(_row(pg.size(), word(self.rows), last.device))
        try:
            super().__init__(requests=requests, contexts=contexts, pg=pg)
        finally:
            last.splits_tensors.pop()
        index = max(i for i, a in enumerate(self._awaitables) if a is last)
        self._lengths[index] -= 1
        if sum(self._lengths) != self.rows:
            raise RuntimeError(
                f"torchrec's fused splits awaitable counts {sum(self._lengths)} rows, not {self.rows}"
            )
        self._splits_awaitable = _Rows(self._splits_awaitable, self.rows)
        self.carries = True

    def words(self) -> list[int]:
        return self._splits_awaitable.words()


class StatusOnly:
    """What a rank without the batch sends where the others send their fused splits: `rows` rows
    of zero splits (the shape the others send) and, where the others send `StatusSplits`, its
    word."""

    def __init__(self, pg: Any, rows: int, word: int | None, device: torch.device) -> None:
        tensors = [_row(pg.size(), 0, device) for _ in range(rows)]
        tensors += [] if word is None else [_row(pg.size(), word, device)]
        self.rows = rows
        self._splits_awaitable = _Rows(SplitsAllToAllAwaitable(tensors, pg), rows)
        self.carries = word is not None

    def words(self) -> list[int]:
        return self._splits_awaitable.words()

    def wait(self) -> list[Any]:
        raise RuntimeError("a rank that sent only its status has no batch to distribute")


def settle_splits(fused: list[tuple[list[str], Any]]) -> None:
    """Wait for the splits all-to-all of each awaitable of a batch the ranks refused
    (`fuse_splits_requests`' or `StatusOnly`), starting no values all-to-all: none is left in
    flight, on any group."""
    for _, awaitable in fused:
        if getattr(awaitable, "_splits_awaitable", None) is not None:
            awaitable._splits_awaitable.wait()


def _row(world: int, value: int, device: torch.device) -> torch.Tensor:
    return torch.full((world,), value, dtype=torch.int64, device=device)


def splits_shape(fused: list[tuple[list[str], Any]]) -> list[tuple[Any, int, torch.device, bool]] | None:
    """What one batch's `fuse_splits_requests(..., carrier=...)` sends, so that a rank without a batch
    can send the same: per group, its process group, the number of splits rows, their device, and
    whether the status rides there. None if no group spans every rank (the status cannot ride)."""
    shape = []
    for _, awaitable in fused:
        metas = [a for a in getattr(awaitable, "_awaitables", []) if isinstance(a, KJTSplitsAllToAllMeta)]
        if metas and metas[0].pg is not None:
            carries = isinstance(awaitable, StatusSplits)
            shape.append((metas[0].pg, sum(awaitable._lengths), metas[0].device, carries))
    return shape if any(carries for *_, carries in shape) else None


_FIELDS_USED = {
    KJTAllToAll: ("_pg", "_splits", "_splits_cumsum", "_stagger"),
}
_AWAITABLE_FIELDS = ("_awaitables", "_lengths", "_splits_awaitable")
_INPUT_DISTS = (
    "TwSparseFeaturesDist",
    "RwSparseFeaturesDist",
    "CwSparseFeaturesDist",
    "DpSparseFeaturesDist",
)
"""torchrec's input dists whose forward issues nothing but its KJTAllToAll (or nothing at all)."""


def riding_fits(modules: list[nn.Module]) -> str | None:
    """None if statuses can ride on these sharded modules' fused splits; else why not (the
    pipeline then votes on every batch). Decided from the code alone, so the same on every rank
    that runs the same torchrec and model."""
    names = set(FusedKJTListSplitsAwaitable.__init__.__code__.co_names)
    missing = [f for f in _AWAITABLE_FIELDS if f not in names]
    if missing:
        return f"torchrec's FusedKJTListSplitsAwaitable no longer sets {', '.join(missing)}"
    for module in modules:
        for child in module.modules():
            for input_dist in getattr(child, "_input_dists", None) or []:
                kind = type(input_dist)
                if not any(
                    c.__name__ in _INPUT_DISTS and c.__module__.startswith("torchrec.") for c in kind.__mro__
                ):
                    return f"input dist {kind.__qualname__} may issue collectives of its own"
                a2a = getattr(input_dist, "_dist", None)
                if a2a is None:
                    continue
                if not isinstance(a2a, KJTAllToAll):
                    return f"input dist {kind.__qualname__} sends with {type(a2a).__qualname__}"
                absent = [f for f in _FIELDS_USED[KJTAllToAll] if not hasattr(a2a, f)]
                if absent:
                    return f"torchrec's KJTAllToAll has no {', '.join(absent)}"
    return None
