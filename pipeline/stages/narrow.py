"""Narrowed ids: the KeyedJaggedTensor handed to a sharded module's input_dist carries int32 ids and
lengths, so that the input all-to-all sends 4 bytes an id instead of 8.

What is narrowed: for each pipelined call site of an embedding-bag collection (torchrec's sharded
EBC, its feature-processed and fused forms, and subclasses such as the tiered one) whose every table
has fewer than 2^31 rows, a copy of the KJT with its values (ids) and lengths as int32; the weights
and every other field are the original's tensors. The batch is not touched: what the model reads of
it outside the sharded modules is what the dataloader made. Every sharding type takes it: table- and
column-wise send the copy as it is, row-wise bucketizes it first (fbgemm's `block_bucketize_sparse_
features` keeps the ids' dtype and casts the block sizes to it), data-parallel sends nothing and
looks the copy up locally (a module whose every table is data-parallel is not narrowed: nothing to
save). The lookup widens what it receives (torchrec's batched kernels call
`values().to(index_type)` and `offsets().to(offset_type)`, int64 unless the user's fused params say
otherwise; the feature processors call `offsets().long()`), so the rows, sums and gradients are the
ones the int64 ids give: the numerics cannot change.

When: decided once per call site, at the first pipelined batch, so every rank decides alike: an
all-to-all's receiver allocates what it receives in the dtype it sends itself, so every rank must send
the same dtype, whatever its batch holds. A site may be narrowed where its module allows it
(`decide`). By default (`narrow_ids=None`) it is narrowed only where the ranks send enough ids a batch
for the saving to outweigh the cost (`NARROW_FROM`): the ranks exchange the first batch's count of
ids per site, so each decides on the same list. `narrow_ids=True` narrows every site its module
allows, whatever the size; False none. Nothing is narrowed at one rank, where the all-to-all moves
nothing between ranks to save. Not narrowed (with the reason in the rewrite report): a module of
another kind (sequence collections return the lengths and ids they were sent to the model;
managed-collision modules remap raw ids), a table with 2^31 rows or more or a virtual one (its block
sizes and ids need int64), a kernel that does not say that it widens (`widens_ids`), and under the
default, a site below `NARROW_FROM`.

The check, per batch and per KJT (`narrow_kjt`, on the data_dist stream, before the splits
all-to-all): one pass for the ids' minimum and maximum (`torch.aminmax`; on a GPU, one
synchronization, as torchrec's input_dist already has for the splits), one for the lengths' (a
hundredth of the ids), then one pass each for the casts. Where the malformed-batch check
(`check_kjts`, on by default) passed the same tensors against tables below 2^31 rows, its pass
stands for the first two (`KJTCheck.in_int32`): only the casts remain. Ids and lengths in
[0, 2^31) are cast exactly. An id outside that range is outside every table (each has fewer than
2^31 rows), and a plain cast would wrap it (2^32 + 3 to row 3); it is saturated instead (to -2^31
or 2^31 - 1, one more pass, only then), so it stays outside every table: the malformed-batch check
(`check_kjts`, which runs before input_dist and stops every rank) or fbgemm's bounds check still
sees a bad id, and a note in the rewrite report says which call site and batch. Sending that batch
unnarrowed is not an option: the other ranks send int32. One difference remains, only without
`check_kjts`: row-wise may bucketize a saturated id to another rank than the original id (out of
range on both), so the zeroed lookup of fbgemm's default bounds check reads another shard's row 0.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.batched_embedding_kernel import BaseBatchedEmbedding, BaseBatchedEmbeddingBag
from torchrec.distributed.embedding_kernel import BaseEmbedding
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.fp_embeddingbag import ShardedFeatureProcessedEmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from pipeline.ranks.kjt_check import table_configs

__all__ = [
    "INT32_ROWS",
    "NARROW_FROM",
    "NarrowIds",
    "Narrowed",
    "decide",
    "every_rank",
    "narrow_kjt",
    "originals",
]

INT32_ROWS = 2**31
"""Tables below this many rows have every valid id in int32."""
NARROW_FROM = 16384
"""Under the default, a call site is narrowed where the ranks' mean count of ids in its input, in the
first pipelined batch, is at least this (128 KiB of int64 ids). Narrowing saves 4 bytes an id on the
wire (at 1 Gbit, 32 ns an id; at 100 Mbit, 320 ns) and costs two casts and a fixed cost a batch.
Measured on 2 CPU ranks: every config of at least 18,000 ids a batch took at most the wide step
narrowed, over loopback as over a link (narrowed / wide, medians: 0.87-1.01 over loopback on three
configs of 18-41 thousand ids, docs/results/narrow-small-loopback.md; 0.94 and 0.95 over 1 Gbit,
narrow-small-1gbit.md; 0.58 and 0.69 over 100 Mbit, narrow-100mbit.md; the wide step 1.06-1.11 of
the narrowed one over loopback at 200 thousand ids and more, narrow-loopback-3.md). The configs it
cost on are below: `tiny` (under 1,000 ids, 1.09 of the wide step over loopback, narrow-loopback-3.md)
and `demo` (about 5,000: 2 % over 1 Gbit, narrow-1gbit-run1.md)."""
_LOW, _HIGH = -(2**31), 2**31 - 1
_INTEGERS = {torch.int32, torch.int64}
_MODULES = (ShardedEmbeddingBagCollection, ShardedFeatureProcessedEmbeddingBagCollection)
"""The sharded modules whose input_dist and lookup are known to take int32 ids and lengths."""
_KERNELS = (BaseBatchedEmbeddingBag, BaseBatchedEmbedding)
"""torchrec's kernels, which widen the ids they receive; another kernel says so by a class
attribute `widens_ids = True`."""


def decide(module: nn.Module) -> str | None:
    """None if the ids of `module`'s input may be narrowed; else why not."""
    if not isinstance(module, _MODULES):
        return f"a {type(module).__name__} (only embedding-bag collections take int32 ids)"
    plan = getattr(module, "module_sharding_plan", None) or {}
    if plan and all(getattr(p, "sharding_type", None) == "data_parallel" for p in plan.values()):
        return "every table is data-parallel (no input all-to-all to narrow)"
    for child in module.modules():
        for config in table_configs(child):
            if getattr(config, "use_virtual_table", False):
                return f"table {config.name!r} is virtual (its ids are hashed, of any size)"
            if int(config.num_embeddings) >= INT32_ROWS:
                return f"table {config.name!r} has {config.num_embeddings} rows (2^31 or more)"
        if isinstance(child, BaseEmbedding) and not (
            isinstance(child, _KERNELS) or getattr(type(child), "widens_ids", False)
        ):
            return f"its kernel {type(child).__name__} does not say it widens int32 ids (widens_ids)"
    return None


@dataclass(frozen=True, slots=True)
class Narrowed:
    """One KJT narrowed by `narrow_kjt`."""

    kjt: KeyedJaggedTensor
    """The copy with int32 ids and lengths (or the original, if both were int32 already)."""
    saturated: bool = False
    """Some id or length was outside int32 and was saturated (a bad id or length)."""


def narrow_kjt(kjt: KeyedJaggedTensor, proven: Container[torch.Tensor] | None = None) -> Narrowed:
    """`kjt`'s ids and lengths as int32 (module docstring: the check and its cost); `kjt` itself
    is not changed. A tensor in `proven` is known to lie in [0, 2^31) and is cast without a check."""
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


class NarrowIds:
    """The input_dist stage's narrowing: which call sites are narrowed (`settle`, at the first
    pipelined batch) and, per batch, their inputs narrowed (`inputs`).

    Args:
        enabled: `InputDistOptions.narrow_ids` (None: where the batches are large enough).
        note: adds one sentence to the rewrite report.
        one_rank: the world is one rank: the all-to-alls move nothing between ranks, so narrowing
            would only cost its passes; nothing is narrowed.
        proven: the tensors the malformed-batch check proved in [0, 2^31) (`KJTCheck.in_int32`).
    """

    def __init__(
        self,
        enabled: bool | None,
        note: Callable[[str], None],
        *,
        one_rank: bool = False,
        proven: Container[torch.Tensor] | None = None,
    ) -> None:
        self._enabled, self._note, self._one_rank, self._proven = enabled, note, one_rank, proven
        self.sites: frozenset[str] = frozenset()
        """The keys of the call sites whose inputs are narrowed (`settle`)."""
        self._saturated: set[str] = set()
        """The call sites for which a saturated batch was noted (once each)."""

    def settle(
        self,
        sites: list[Any],
        sample: Callable[[], Iterable[tuple[Any, list[Any], dict[str, Any]]]],
        gather: Callable[[Any], list[Any]],
    ) -> None:
        """Decide for each call site (`rewrite.CallSite`) and say so in the report. Under the default,
        `sample()` gives each site's inputs in the first pipelined batch, and `gather` every rank's
        counts of their ids (every rank calls it here, once, whenever some site may be narrowed)."""
        self.sites = frozenset()
        if self._enabled is False:
            self._note("ids are not narrowed (narrow_ids=False): the input all-to-all sends them as made")
            return
        if self._one_rank:
            self._note("ids are not narrowed: at one rank the input all-to-all moves nothing")
            return
        refused: dict[str, str] = {}
        for site in sites:
            if (why := decide(site.module)) is not None:
                refused[site.key] = why
        allowed = sorted({site.key for site in sites} - refused.keys())
        if self._enabled is None and allowed:
            counts = dict.fromkeys(allowed, 0)
            for site, args, kwargs in sample():
                if site.key in counts:
                    counts[site.key] += _ids_in([*args, *kwargs.values()])
            every = gather([counts[key] for key in allowed])
            for i, key in enumerate(allowed):
                mean = sum(rank[i] for rank in every) / len(every)
                if mean < NARROW_FROM:
                    refused[key] = (
                        f"about {mean:,.0f} ids a rank a batch, below {NARROW_FROM:,}: too few for the "
                        "saving to outweigh the cost (narrow_ids=True narrows them all the same)"
                    )
        self.sites = frozenset(allowed) - refused.keys()
        if self.sites:
            keys = ", ".join(sorted(self.sites))
            self._note(f"ids and lengths are sent as int32 (every table below 2^31 rows) for {keys}")
        for key, why in refused.items():
            self._note(f"ids are sent as made for {key}: {why}")

    def inputs(
        self, site: Any, args: list[Any], kwargs: dict[str, Any], done: dict[int, Any], batch: int
    ) -> tuple[list[Any], dict[str, Any]]:
        """`site`'s input_dist arguments with every KJT narrowed, if the site is. `done` is the
        batch's: each KJT is narrowed once when several call sites share it, and `originals` reads
        it back; `batch` names the batch in a note. The caller calls it only for `sites`."""

        def one(value: Any) -> Any:
            if not isinstance(value, KeyedJaggedTensor):
                return value
            if id(value) not in done:  # the original is kept there too: its id stays its own
                done[id(value)] = (value, narrow_kjt(value, self._proven))
            narrowed = done[id(value)][1]
            if narrowed.saturated and site.key not in self._saturated:
                self._saturated.add(site.key)
                self._note(
                    f"batch {batch}: an id or length of {site.key}'s input is outside int32 (so outside "
                    "every table); sent saturated, still out of range, never wrapped to a valid row"
                )
            return narrowed.kjt

        return [one(a) for a in args], {name: one(v) for name, v in kwargs.items()}


def every_rank(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, where the pipeline has no ranks' protocol to exchange it
    (`SparseDataDistUtil`): an all-gather on the default group."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _ids_in(values: list[Any]) -> int:
    return sum(v.values().numel() for v in values if isinstance(v, KeyedJaggedTensor))


def originals(done: dict[int, Any]) -> dict[int, KeyedJaggedTensor]:
    """By the id of each narrowed copy in `done` (`NarrowIds.inputs`), the batch's KJT it copies."""
    return {id(narrowed.kjt): kjt for kjt, narrowed in done.values() if narrowed.kjt is not kjt}
