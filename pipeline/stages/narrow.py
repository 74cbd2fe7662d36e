"""Narrowed ids (docs/pipeline.md, "Narrowed ids"): the KeyedJaggedTensor handed to a sharded module's
input_dist is a copy with int32 ids and lengths, so the input all-to-all sends 4 bytes an id instead
of 8. The lookup widens them (torchrec's kernels call `values().to(index_type)`, the feature
processors `offsets().long()`), so rows, sums and gradients are those of the int64 ids. The call
sites are chosen once, at the first pipelined batch, alike on every rank, since an all-to-all's
receiver allocates in its own dtype (`decide`, `NarrowIds.settle`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Container, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.dist_data import KJTAllToAllTensorsAwaitable
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.fp_embeddingbag import ShardedFeatureProcessedEmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from pipeline.ranks.kjt_check import table_configs

__all__ = [
    "INT32_ROWS",
    "NARROW_FROM",
    "RECEIVED_LIMIT",
    "WIDENING_KERNELS",
    "NarrowIds",
    "Narrowed",
    "decide",
    "every_rank",
    "kjts_in",
    "narrow_kjt",
    "originals",
    "receivers_can_widen",
    "widen_received",
]

INT32_ROWS = 2**31
"""Tables below this many rows have every valid id in int32."""
NARROW_FROM = 16384
"""Under the default, a call site is narrowed where the ranks' mean count of ids in its first
pipelined batch is at least this (docs/results/narrow-small-loopback.md)."""
_LOW, _HIGH = -(2**31), 2**31 - 1
_INTEGERS = {torch.int32, torch.int64}
_MODULES = (ShardedEmbeddingBagCollection, ShardedFeatureProcessedEmbeddingBagCollection)
"""The sharded modules whose input_dist and lookup take int32 ids and lengths."""
WIDENING_KERNELS = frozenset({"dense", "fused", "fused_uvm", "fused_uvm_caching", "key_value"})
"""Compute kernels whose torchrec kernels widen the ids and offsets they receive; a module planned on
"custom" takes int32 ids only where its class says `widens_ids = True` (the tiered collection)."""


def decide(module: nn.Module) -> str | None:
    """None if the ids of `module`'s input may be narrowed; else why not. Reads only what every rank
    holds alike: the module's class, its tables' configs and its sharding plan."""
    if not isinstance(module, _MODULES):
        return f"a {type(module).__name__} (only embedding-bag collections take int32 ids)"
    plan = getattr(module, "module_sharding_plan", None) or {}
    if plan and all(getattr(p, "sharding_type", None) == "data_parallel" for p in plan.values()):
        return "every table is data-parallel (no input all-to-all to narrow)"
    for config in table_configs(module):
        if getattr(config, "use_virtual_table", False):
            return f"table {config.name!r} is virtual (its ids are hashed, of any size)"
        if int(config.num_embeddings) >= INT32_ROWS:
            return f"table {config.name!r} has {config.num_embeddings} rows (2^31 or more)"
    for table, sharding in sorted(plan.items()):
        kernel = str(getattr(sharding, "compute_kernel", ""))
        if kernel in WIDENING_KERNELS or (kernel == "custom" and getattr(type(module), "widens_ids", False)):
            continue
        return (
            f"table {table!r} is planned on the {kernel!r} kernel, not one known to widen int32 ids "
            "(a custom kernel's module says so with widens_ids = True)"
        )
    return None


@dataclass(frozen=True, slots=True)
class Narrowed:
    """One KJT narrowed by `narrow_kjt`."""

    kjt: KeyedJaggedTensor  # the copy with int32 ids and lengths (the original, if nothing to narrow)
    saturated: bool = False  # some id or length was outside int32, and was saturated


def narrow_kjt(kjt: KeyedJaggedTensor, proven: Container[torch.Tensor] | None = None) -> Narrowed:
    """`kjt` with int32 ids and lengths, in a copy; a tensor in `proven` (known in [0, 2^31)) is cast
    unchecked. An id outside int32 is saturated, never wrapped onto a valid row (2^32 + 3 to 3), so
    `check_kjts` or fbgemm's bounds check still sees it; without `check_kjts`, row-wise may send it to
    another rank than the original's, whose zeroed lookup then reads that shard's row 0."""
    values, lengths = kjt.values(), kjt.lengths()
    if {values.dtype, lengths.dtype} - _INTEGERS or values.dtype == lengths.dtype == torch.int32:
        return Narrowed(kjt)
    values, bad_values = _cast(values, proven)
    lengths, bad_lengths = _cast(lengths, proven)
    vbe = kjt.variable_stride_per_key()
    copy = KeyedJaggedTensor(
        keys=kjt.keys(),
        values=values,
        weights=kjt.weights_or_none(),
        lengths=lengths,
        stride=None if vbe else kjt.stride(),
        stride_per_key_per_rank=kjt.stride_per_key_per_rank() if vbe else None,
        length_per_key=kjt.length_per_key_or_none(),
        offset_per_key=kjt.offset_per_key_or_none(),
        inverse_indices=kjt.inverse_indices_or_none(),
    )
    return Narrowed(copy, bad_values or bad_lengths)


def _cast(tensor: torch.Tensor, proven: Container[torch.Tensor] | None) -> tuple[torch.Tensor, bool]:
    if proven is not None and tensor in proven:
        return tensor.to(torch.int32), False
    return _to_int32(tensor)


def _to_int32(tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """`tensor` as int32, and whether some entry was outside int32 (saturated, never wrapped)."""
    if tensor.dtype == torch.int32:
        return tensor, False
    if tensor.numel():
        low, high = torch.aminmax(tensor)
        if int(low) < _LOW or int(high) > _HIGH:
            return tensor.clamp(_LOW, _HIGH).to(torch.int32), True
    return tensor.to(torch.int32), False


def receivers_can_widen() -> str | None:
    """None if a receiver of narrowed ids can widen what it received (`widen_received`); else why not."""
    names = set(KJTAllToAllTensorsAwaitable._wait_impl.__code__.co_names)
    missing = [f for f in ("_output_tensors", "_awaitables", "dist_init") if f not in names]
    if missing:
        return f"torchrec's KJTAllToAllTensorsAwaitable no longer reads {', '.join(missing)} when it waits"
    return None


def widen_received(request: Any) -> Any:
    """`request` (a module's values all-to-all), each of its KJT all-to-alls made to widen the
    lengths it received to int64 where their ids number `RECEIVED_LIMIT` or more: the receiver's running
    sum of every sender's lengths (`dist_init`) would wrap past 2^31 in int32."""
    for inner in getattr(request, "awaitables", ()):
        if isinstance(inner, KJTAllToAllTensorsAwaitable) and hasattr(inner, "_output_tensors"):
            inner._wait_impl = functools.partial(_widened_wait, inner, inner._wait_impl)
    return request


RECEIVED_LIMIT = INT32_ROWS
"""Ids received in one all-to-all from which its lengths are summed in int64 (`widen_received`)."""


def _widened_wait(inner: KJTAllToAllTensorsAwaitable, wait: Callable[[], Any]) -> Any:
    # the wrapper on the instance refers back to it: dropped at the wait, so that no reference cycle
    # holds the received tensors until the garbage collector's next full pass
    inner.__dict__.pop("_wait_impl", None)
    splits = getattr(inner, "_output_splits", None)
    if not isinstance(splits, dict):
        raise RuntimeError(
            "torchrec's KJTAllToAllTensorsAwaitable has no _output_splits by label, so a receiver of "
            "narrowed ids cannot tell its lengths from its ids; pass InputDistOptions(narrow_ids=False)"
        )
    labels = list(splits)
    if "lengths" in labels and "values" in labels:
        for work in inner._awaitables:
            work.wait()
        tensors = inner._output_tensors
        at = labels.index("lengths")
        if tensors[labels.index("values")].numel() >= RECEIVED_LIMIT and tensors[at].dtype == torch.int32:
            tensors[at] = tensors[at].to(torch.int64)
    return wait()


class NarrowIds:
    """The input_dist stage's narrowing: which call sites are narrowed (`settle`), and each batch's
    inputs narrowed (`inputs`). `enabled`: `InputDistOptions.narrow_ids`; `note` adds a sentence to the
    report; `proven` and `untabled`: `KJTCheck.in_int32` and `KJTCheck.untabled`."""

    def __init__(
        self,
        enabled: bool | None,
        note: Callable[[str], None],
        *,
        one_rank: bool = False,
        proven: Container[torch.Tensor] | None = None,
        untabled: Container[str] = frozenset(),
    ) -> None:
        self._enabled, self._note, self._one_rank, self._proven = enabled, note, one_rank, proven
        self._untabled = untabled
        self.sites: frozenset[str] = frozenset()  # the keys of the narrowed call sites (`settle`)
        self._saturated: set[str] = set()  # the call sites whose saturated batch was noted

    def settle(
        self,
        sites: list[Any],
        sample: Callable[[], Iterable[tuple[Any, list[Any], dict[str, Any]]]],
        gather: Callable[[Any], list[Any]],
    ) -> None:
        """Decide for each call site (`rewrite.CallSite`) and say so in the report; `sample()` gives each
        site's inputs in the first pipelined batch, `gather` every rank's counts of ids (on every rank)."""
        self.sites = frozenset()
        if self._enabled is False:
            self._note(
                "ids are not narrowed (InputDistOptions(narrow_ids=False)): the input all-to-all sends "
                "them as made"
            )
            return
        if self._one_rank:
            self._note("ids are not narrowed: at one rank the input all-to-all moves nothing")
            return
        refused: dict[str, str] = {}
        widening = receivers_can_widen()
        for site in sites:
            if (why := decide(site.module) or widening) is not None:
                refused[site.key] = why
        allowed = sorted({site.key for site in sites} - refused.keys())
        if self._enabled is None and allowed:
            counts = dict.fromkeys(allowed, 0)
            for site, args, kwargs in sample():
                if site.key in counts:
                    counts[site.key] += sum(kjt.values().numel() for kjt in kjts_in([(site, args, kwargs)]))
            every = gather([counts[key] for key in allowed])
            for i, key in enumerate(allowed):
                mean = sum(rank[i] for rank in every) / len(every)
                if mean < NARROW_FROM:
                    refused[key] = (
                        f"about {mean:,.0f} ids a rank a batch, below {NARROW_FROM:,}: too few for the "
                        "saving to outweigh the cost (InputDistOptions(narrow_ids=True) narrows them all "
                        "the same)"
                    )
        self.sites = frozenset(allowed) - refused.keys()
        if self.sites:
            keys = ", ".join(sorted(self.sites))
            self._note(f"ids and lengths are sent as int32 (every table below 2^31 rows) for {keys}")
            seen = {k for kjt in kjts_in(sample()) for k in kjt.keys()} if self._untabled else set()
            features = sorted(f for f in seen if f in self._untabled)
            if features:
                self._note(
                    f"feature(s) {', '.join(map(repr, features))} index no table of the model: their ids "
                    "are checked only to be in [0, 2^31) for the narrowing's proof, not against a table"
                )
        for key, why in refused.items():
            self._note(f"ids are sent as made for {key}: {why}")

    def inputs(
        self, site: Any, args: list[Any], kwargs: dict[str, Any], done: dict[int, Any], batch: int
    ) -> tuple[list[Any], dict[str, Any]]:
        """`site`'s input_dist arguments (a site in `sites`) with every KJT narrowed. `done` is the
        batch's memo (each shared KJT narrowed once; `originals` reads it); `batch` is for notes."""

        def one(value: Any) -> Any:
            if not isinstance(value, KeyedJaggedTensor):
                return value
            if id(value) not in done:  # the original is kept there too: its id stays its own
                done[id(value)] = (value, narrow_kjt(value, self._proven))
            narrowed = done[id(value)][1]
            if narrowed.saturated and site.key not in self._saturated:
                self._saturated.add(site.key)
                feature = _outside_int32(value)
                tabled = feature is not None and feature not in self._untabled
                self._note(
                    f"batch {batch}: an id or length of {site.key}'s input is outside int32 "
                    + (f"(feature {feature!r}, " if feature else "(")
                    + ("so outside its table" if tabled else "a feature without a table" if feature else "")
                    + "); sent saturated, still out of range, never wrapped to a valid row"
                )
            return narrowed.kjt

        return [one(a) for a in args], {name: one(v) for name, v in kwargs.items()}


def _outside_int32(kjt: KeyedJaggedTensor) -> str | None:
    """The first feature of `kjt` with an id outside int32 (None: only a length is outside)."""
    values = kjt.values()
    outside = (values < _LOW) | (values > _HIGH)
    if not bool(outside.any()):
        return None
    at = int(outside.nonzero()[0])
    ends = torch.cumsum(torch.tensor(kjt.length_per_key()), 0)
    return kjt.keys()[int(torch.searchsorted(ends, at, right=True))]


def every_rank(obj: Any) -> list[Any]:
    """Every rank's `obj` (an all-gather on the default group), for `SparseDataDistUtil`."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def kjts_in(inputs: Iterable[tuple[Any, list[Any], dict[str, Any]]]) -> Iterator[KeyedJaggedTensor]:
    """The KeyedJaggedTensors among the call sites' `(site, args, kwargs)` inputs."""
    for _, args, kwargs in inputs:
        yield from (v for v in (*args, *kwargs.values()) if isinstance(v, KeyedJaggedTensor))


def originals(done: dict[int, Any]) -> dict[int, KeyedJaggedTensor]:
    """By the id of each narrowed copy in `done` (`NarrowIds.inputs`), the batch's KJT it copies."""
    return {id(narrowed.kjt): kjt for kjt, narrowed in done.values() if narrowed.kjt is not kjt}
