"""Fuse the splits all-to-alls of several sharded modules into one collective.

torchrec's KJTAllToAll issues its splits all-to-all as soon as it is called. Replacing its forward by
`_SplitsOnly` makes it return the metadata instead (a `KJTSplitsAllToAllMeta`), so that the pipeline
can send the splits of every module on one process group in a single all-to-all
(`FusedKJTListSplitsAwaitable`). Input dists are created lazily on a module's first input, so this is
installed after the first batch.

A fused splits all-to-all can also carry one number per rank, its word for the batch
(`StatusSplits`; the pipeline packs its status, its row count and an observation into it): the ranks
learn whether every rank has the batch from the collective they issue anyway, before any values
move. A rank without the batch sends zero splits of the same shape with its word (`StatusOnly`), as
recorded from an earlier batch (`splits_shape`). Each rank reads the others' words at its own row
count; the word's row count lets it check that what it read is a word.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.dist_data import KJTAllToAll, SplitsAllToAllAwaitable
from torchrec.distributed.embedding_sharding import FusedKJTListSplitsAwaitable, KJTSplitsAllToAllMeta
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = [
    "StatusOnly",
    "StatusSplits",
    "fuse_splits_requests",
    "input_dists_ready",
    "install_fused_splits",
    "kjt_all_to_alls",
    "one_by_one",
    "settle_splits",
    "splits_shape",
]


class _SplitsOnly:
    def __init__(self, a2a: KJTAllToAll) -> None:
        self._a2a = a2a

    def __call__(self, kjt: KeyedJaggedTensor) -> KJTSplitsAllToAllMeta:
        a2a = self._a2a
        pg = a2a._pg
        rank = dist.get_rank(pg)
        bounds = a2a._splits_cumsum
        with torch.no_grad():
            device = kjt.values().device
            input_splits = kjt.dist_splits(a2a._splits)
            splits_tensors = [torch.tensor(s, device=device) for s in input_splits]
            if not kjt.variable_stride_per_key():
                splits_tensors.append(torch.tensor([kjt.stride()] * pg.size(), device=device))
            return KJTSplitsAllToAllMeta(
                pg=pg,
                _input=kjt,
                splits=a2a._splits,
                splits_tensors=splits_tensors,
                input_splits=input_splits,
                input_tensors=kjt.dist_tensors(),
                labels=kjt.dist_labels(),
                keys=kjt.keys()[bounds[rank] : bounds[rank + 1]],
                device=device,
                stagger=a2a._stagger,
            )


def kjt_all_to_alls(module: nn.Module) -> list[KJTAllToAll]:
    """Every KJTAllToAll in the input dists of `module` and its children (once they exist)."""
    found = []
    for child in module.modules():
        for input_dist in getattr(child, "_input_dists", None) or []:
            a2a = getattr(input_dist, "_dist", None)
            if isinstance(a2a, KJTAllToAll):
                found.append(a2a)
    return found


def input_dists_ready(modules: list[nn.Module]) -> bool:
    """Whether every module has created its input dists (they are made on the first input)."""
    return not any(
        getattr(child, "_has_uninitialized_input_dist", False) for m in modules for child in m.modules()
    )


def install_fused_splits(modules: list[nn.Module]) -> Callable[[], None]:
    """Make the modules' KJT all-to-alls return splits metadata; returns the undo function."""
    patched = [a2a for m in modules for a2a in kjt_all_to_alls(m) if "forward" not in vars(a2a)]
    for a2a in patched:
        a2a.forward = _SplitsOnly(a2a)

    def undo() -> None:
        for a2a in patched:
            vars(a2a).pop("forward", None)

    return undo


class _One:
    """Makes one module's splits awaitable look like a fused one (a list of one result)."""

    def __init__(self, request: Any) -> None:
        self._request = request

    def wait(self) -> list[Any]:
        return [self._request.wait()]


def fuse_splits_requests(
    requests: dict[str, Any],
    module_contexts: dict[str, Any],
    *,
    word: Callable[[int], int] | None = None,
) -> list[tuple[list[str], Any]]:
    """One splits all-to-all per process group, over every module using that group (`names, awaitable`
    pairs whose `wait()` returns the values awaitables in `names` order). Before the input dists are
    patched (`install_fused_splits`) a module's splits request is already issued: `one_by_one` wraps
    those instead. With `word` (this rank's word, from the number of splits rows sent before it), the
    first group spanning every rank carries it (`StatusSplits`)."""
    groups: dict[int, tuple[Any, list[str]]] = {}
    for name, request in requests.items():
        metas = [a for a in getattr(request, "awaitables", []) if isinstance(a, KJTSplitsAllToAllMeta)]
        pg = metas[0].pg if metas else None
        groups.setdefault(id(pg), (pg, []))[1].append(name)
    fused = []
    for pg, names in groups.values():
        inputs = {
            "requests": [requests[n] for n in names],
            "contexts": [module_contexts[n] for n in names],
            "pg": pg,
        }
        if word is not None and _spans_world(pg):
            fused.append((names, StatusSplits(**inputs, word=word)))
            word = None
        else:
            fused.append((names, FusedKJTListSplitsAwaitable(**inputs)))
    return fused


def _spans_world(pg: Any) -> bool:
    return pg is not None and pg.size() == dist.get_world_size()


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
        return list(rows[self._status_row])


class StatusSplits(FusedKJTListSplitsAwaitable):
    """torchrec's fused splits all-to-all with one row more: this rank's word for the batch
    (`word(rows)`, from the number of splits rows before it), which every rank receives (`words()`,
    one per rank) before the values all-to-alls, which `wait()` starts, are issued. The row rides on
    the last module's splits while the all-to-all is built and is left out when the splits are read.

    Raises:
        RuntimeError: torchrec's fused awaitable is not of the shape this class edits (a torchrec
            release that changed it); the pipeline then votes instead (`riding_fits`).
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
    """What one batch's `fuse_splits_requests(..., status=...)` sends, so that a rank without a batch
    can send the same: per group, its process group, the number of splits rows, their device, and
    whether the status rides there. None if no group spans every rank (the status cannot ride)."""
    shape = []
    for _, awaitable in fused:
        metas = [a for a in getattr(awaitable, "_awaitables", []) if isinstance(a, KJTSplitsAllToAllMeta)]
        if metas and metas[0].pg is not None:
            carries = isinstance(awaitable, StatusSplits)
            shape.append((metas[0].pg, sum(awaitable._lengths), metas[0].device, carries))
    return shape if any(carries for *_, carries in shape) else None


def one_by_one(requests: dict[str, Any]) -> list[tuple[list[str], Any]]:
    """Each module's own splits request, in the shape `fuse_splits_requests` returns."""
    return [([name], _One(request)) for name, request in requests.items()]
