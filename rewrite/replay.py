"""The per-batch half of a rewrite: each call site's inputs read from a batch, and the fused splits.

Everything that does not change once the rewrite settles is decided once, when a module is pipelined
(`Replay.add`): which call sites there are, and how each reads its arguments. An argument that
is a path from the batch, or a constant, is read by its program's `ArgInfo.read` (a chain of
attribute reads is one `operator.attrgetter`); any other program (a method call, a construction, a
postproc, a user's function) is built with the batch's postprocs and a per-batch cache, so that a
value several call sites share is computed once (`rewrite.arginfo`).

torchrec's KJTAllToAll issues its splits all-to-all as soon as it is called. Replacing its forward by
`_SplitsOnly` makes it return the metadata instead (a `KJTSplitsAllToAllMeta`), so that the pipeline
can send the splits of every module on one process group in a single all-to-all
(`FusedKJTListSplitsAwaitable`). Input dists are created lazily on a module's first input, so this is
installed after the first batch (`Replay.fuse_splits`). The ranks' protocol can have the collective
of the first group spanning every rank built by a subclass of its own
(`fuse_splits_requests(status_splits=...)`: the status row of `pipeline.ranks.riding`); this module knows
nothing of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.dist_data import KJTAllToAll
from torchrec.distributed.embedding_sharding import FusedKJTListSplitsAwaitable, KJTSplitsAllToAllMeta
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from rewrite.arginfo import CallArgs, PostprocCall
from rewrite.sites import CallSite, PipelinedModule

__all__ = [
    "Replay",
    "fuse_splits_requests",
    "input_dists_ready",
    "install_fused_splits",
    "kjt_all_to_alls",
    "one_by_one",
]

Reader = Callable[[Any], Any]
"""An argument's value as a function of the batch alone (`ArgInfo.read`)."""


@dataclass(frozen=True, slots=True)
class _SiteReader:
    """How one call site reads its `(args, kwargs)` from a batch."""

    site: CallSite
    args: tuple[Reader, ...] | None
    """A reader per positional argument; None: `site.args.build` with postprocs and a cache."""
    kwargs: tuple[tuple[str, Reader], ...] = ()

    @classmethod
    def of(cls, site: CallSite) -> _SiteReader:
        """Paths from the batch and constants are read by their programs' `read`; other programs
        (and a user's function) need the batch's postprocs and cache."""
        call = site.args
        if not isinstance(call, CallArgs) or not all(
            a.source is None and a.is_path for a in (*call.args, *call.kwargs.values())
        ):
            return cls(site, None)
        return cls(site, tuple(a.read for a in call.args), tuple((k, a.read) for k, a in call.kwargs.items()))


@dataclass(kw_only=True, slots=True)
class Replay:
    """What a rewrite does for each batch once it is settled (`rewrite.model.Rewrite` extends it)."""

    modules: list[PipelinedModule] = field(default_factory=list)
    """The pipelined modules (empty while `needs_recording`)."""
    sites: list[CallSite] = field(default_factory=list)
    """Every call site of every pipelined module, in order: what input_dist runs for, per batch."""
    needs_recording: bool = False
    """The first forward must run in `Rewrite.record` before anything is pipelined."""
    fused: bool = False
    """The splits all-to-alls of the modules return metadata to be fused (`fuse_splits`)."""
    postproc_forwards: dict[str, Callable[..., Any]] = field(default_factory=dict)
    """The original forward of each postproc module a program may call, by FQN."""
    _readers: list[_SiteReader] = field(default_factory=list)
    _undo_fuse: Callable[[], None] | None = None

    def add(self, module: PipelinedModule) -> None:
        """Add `module` and its call sites; decide, once, how each site reads its inputs."""
        self.modules.append(module)
        self.sites.extend(module.sites)
        self._readers.extend(_SiteReader.of(site) for site in module.sites)

    def site_inputs(
        self, batch: Any, postproc_results: dict[str, Any]
    ) -> Iterator[tuple[CallSite, list, dict]]:
        """Each call site with its `(args, kwargs)` for `batch`, as forward will pass them: postprocs
        run once per batch into `postproc_results` (keyed by FQN), and a program that several call
        sites share is computed once."""
        cache: dict = {}
        postproc = partial(self.run_postproc, results=postproc_results)
        for reader in self._readers:
            if reader.args is None:
                args, kwargs = reader.site.args.build(batch, postproc, cache)
            else:
                args = [read(batch) for read in reader.args]
                kwargs = {name: read(batch) for name, read in reader.kwargs} if reader.kwargs else {}
            yield reader.site, args, kwargs

    def run_postproc(self, call: PostprocCall, batch: Any, results: dict[str, Any]) -> Any:
        """Run postproc `call` on `batch` with its original forward, once per batch (`results`)."""
        if call.fqn not in results:
            args, kwargs = call.args.build(batch, partial(self.run_postproc, results=results))
            results[call.fqn] = self.postproc_forwards[call.fqn](*args, **kwargs)
        return results[call.fqn]

    def fuse_splits(self) -> bool:
        """Fuse the splits all-to-alls once every input dist exists; True when fused (then `fused`
        says so without a call)."""
        if not self.fused and input_dists_ready([m.module for m in self.modules]):
            self._undo_fuse = install_fused_splits([m.module for m in self.modules])
            self.fused = True
        return self.fused

    def unfuse_splits(self) -> None:
        """Undo `fuse_splits`: the all-to-alls issue their own splits again."""
        if self._undo_fuse is not None:
            self._undo_fuse()
        self._undo_fuse, self.fused = None, False


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
    status_splits: Callable[..., Any] | None = None,
) -> list[tuple[list[str], Any]]:
    """One splits all-to-all per process group, over every module using that group (`names, awaitable`
    pairs whose `wait()` returns the values awaitables in `names` order). Before the input dists are
    patched (`install_fused_splits`) a module's splits request is already issued: `one_by_one` wraps
    those instead. With `status_splits` (a subclass of torchrec's fused awaitable taking the same
    keywords, e.g. the ranks' `pipeline.ranks.riding.StatusSplits`), the first group spanning every
    rank is fused by it instead."""
    groups: dict[int, tuple[Any, list[str]]] = {}
    for name, request in requests.items():
        pg = None  # the group of the request's first splits all-to-all (the schedule may move it)
        for awaitable in getattr(request, "awaitables", ()):
            if isinstance(awaitable, KJTSplitsAllToAllMeta):
                pg = awaitable.pg
                break
        groups.setdefault(id(pg), (pg, []))[1].append(name)
    fused = []
    for pg, names in groups.values():
        inputs = {
            "requests": [requests[n] for n in names],
            "contexts": [module_contexts[n] for n in names],
            "pg": pg,
        }
        if status_splits is not None and pg is not None and pg.size() == dist.get_world_size():
            fused.append((names, status_splits(**inputs)))
            status_splits = None
        else:
            fused.append((names, FusedKJTListSplitsAwaitable(**inputs)))
    return fused


def one_by_one(requests: dict[str, Any]) -> list[tuple[list[str], Any]]:
    """Each module's own splits request, in the shape `fuse_splits_requests` returns."""
    return [([name], _One(request)) for name, request in requests.items()]
