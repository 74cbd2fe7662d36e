"""Fuse the splits all-to-alls of several sharded modules into one collective.

torchrec's KJTAllToAll issues its splits all-to-all as soon as it is called. Replacing its forward by
`_SplitsOnly` makes it return the metadata instead (a `KJTSplitsAllToAllMeta`), so that the pipeline
can send the splits of every module on one process group in a single all-to-all
(`FusedKJTListSplitsAwaitable`). Input dists are created lazily on a module's first input, so this is
installed after the first batch.

The ranks' protocol can have the collective of the first group spanning every rank built by a
subclass of its own (`fuse_splits_requests(carrier=...)`: the status row of `pipeline.ranks.rows`);
this module knows nothing of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.dist_data import KJTAllToAll
from torchrec.distributed.embedding_sharding import FusedKJTListSplitsAwaitable, KJTSplitsAllToAllMeta
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = [
    "fuse_splits_requests",
    "input_dists_ready",
    "install_fused_splits",
    "kjt_all_to_alls",
    "one_by_one",
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
    carrier: Callable[..., Any] | None = None,
) -> list[tuple[list[str], Any]]:
    """One splits all-to-all per process group, over every module using that group (`names, awaitable`
    pairs whose `wait()` returns the values awaitables in `names` order). Before the input dists are
    patched (`install_fused_splits`) a module's splits request is already issued: `one_by_one` wraps
    those instead. With `carrier` (a subclass of torchrec's fused awaitable taking the same
    keywords, e.g. the ranks' `pipeline.ranks.rows.StatusSplits`), the first group spanning every
    rank is fused by it instead."""
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
        if carrier is not None and _spans_world(pg):
            fused.append((names, carrier(**inputs)))
            carrier = None
        else:
            fused.append((names, FusedKJTListSplitsAwaitable(**inputs)))
    return fused


def _spans_world(pg: Any) -> bool:
    return pg is not None and pg.size() == dist.get_world_size()


def one_by_one(requests: dict[str, Any]) -> list[tuple[list[str], Any]]:
    """Each module's own splits request, in the shape `fuse_splits_requests` returns."""
    return [([name], _One(request)) for name, request in requests.items()]
