"""The torchrec compute kernel: pooled lookups and the fused optimizer update on cache slots only.

`TieredEmbeddingBag` is what torchrec's grouped lookup calls for a group of tables planned with
`EmbeddingComputeKernel.CUSTOMIZED_KERNEL`. Each table shard has a `RowStore` (disk) and a
`RowCache` (RAM). `prefetch(features)` acquires the batch's rows (one `Pin` per table);
`forward(features, pins)` pools from cache slots (prefetching inline when no pins are given, as in
the plain loop), and its backward applies the optimizer to the rows in their slots (torchrec's
fused, in-backward semantics: gradients of one row are summed over the batch, then applied once),
marks them dirty and releases the pins. Optimizers: SGD and row-wise Adagrad.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embedding_kernel import BaseEmbedding, get_state_dict
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
from torchrec.modules.embedding_configs import PoolingType
from torchrec.optim.fused import FusedOptimizer, FusedOptimizerModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tiered.cache import Pin, RowCache
from tiered.optim import TieredOptimizer, UpdateRule
from tiered.options import TieredOptions
from tiered.policy import make_policy
from tiered.readers import default_read_threads, run_all
from tiered.store import RowStore

__all__ = ["TieredEmbeddingBag"]


@dataclass(eq=False)
class _Batch:
    """What forward hands to backward: pins per table and the per-feature slot layout."""

    pins: list[Pin]
    slots: list[torch.Tensor]
    """Per feature: the cache slot of each id."""
    offsets: list[torch.Tensor]
    """Per feature: bag offsets (batch + 1 entries, starting at 0)."""
    weights: list[torch.Tensor | None] = field(default_factory=list)
    """Per feature: per-sample weights, or None."""


class TieredEmbeddingBag(BaseEmbedding, FusedOptimizerModule):
    """Pooled embedding bags of one group of table shards, stored on disk and cached in RAM.

    Args:
        config: torchrec's group of table shards (all planned with the customized kernel).
        pg: the sharding's process group (for state_dict metadata).
        options: where the stores live, cache sizes, policy.
        prefix: distinguishes the store files of this module from those of others.
    """

    def __init__(
        self,
        config: GroupedEmbeddingConfig,
        pg: dist.ProcessGroup | None,
        options: TieredOptions,
        *,
        prefix: str,
    ) -> None:
        super().__init__()
        self._config = config
        self._pg = pg
        self._rule = UpdateRule.from_fused_params(config.fused_params)
        self._mean = config.pooling == PoolingType.MEAN
        rank = dist.get_rank() if dist.is_initialized() else 0
        self._read_threads = options.read_threads or default_read_threads()
        self.caches: list[RowCache] = []
        self._feature_table: list[int] = []
        self._dims: list[int] = []
        names = [t.name for t in config.embedding_tables]
        if len(set(names)) < len(names):
            raise ValueError(
                f"the tiered kernel holds one shard per table per rank; tables {names} have several on "
                f"rank {rank}: place their column-wise shards on different ranks"
            )
        for index, table in enumerate(config.embedding_tables):
            offsets = table.local_metadata.shard_offsets if table.local_metadata else [0, 0]
            name = f"{prefix}{table.name}.r{rank}.row{offsets[0]}.col{offsets[1]}"
            store = _open_store(options, name, table, self._rule.state_width)
            capacity = options.capacity(table.local_rows)
            policy = make_policy(options.policy, capacity, table.local_rows)
            self.caches.append(RowCache(store, capacity, policy, name=name))
            self._feature_table += [index] * table.num_features()
            self._dims += [table.local_cols] * table.num_features()
        # Makes the pooled output require grad, so that backward (the fused update) runs.
        self._anchor = torch.empty(0, requires_grad=True)
        self._params = {
            t.name: nn.Parameter(c.store.weights(), requires_grad=False)
            for t, c in zip(config.embedding_tables, self.caches, strict=True)
        }
        self._optim = TieredOptimizer(
            {f"{name}.weight": p for name, p in self._params.items()},
            self.caches,
            self._rule,
            flush=self.flush,
            purge=self.purge,
        )
        for param in self._params.values():
            param._in_backward_optimizers = [self._optim]

    @property
    def config(self) -> GroupedEmbeddingConfig:
        return self._config

    @property
    def fused_optimizer(self) -> FusedOptimizer:
        return self._optim

    # -- prefetch and lookup ------------------------------------------------------------------

    def prefetch(self, features: KeyedJaggedTensor) -> list[Pin]:
        """Make the rows of `features` resident; one Pin per table, to pass to `forward`."""
        with torch.no_grad():
            segments = _segments(features, len(self._feature_table))
            ids = [
                torch.cat([seg for seg, t in zip(segments, self._feature_table, strict=True) if t == i])
                for i in range(len(self.caches))
            ]
            calls = [functools.partial(c.acquire, i) for c, i in zip(self.caches, ids, strict=True)]
            return run_all(calls, self._read_threads)

    def forward(self, features: KeyedJaggedTensor, pins: list[Pin] | None = None) -> torch.Tensor:
        """Pooled embeddings `[batch, sum of dims]` in feature order (prefetches if `pins` is None)."""
        if pins is None:
            pins = self.prefetch(features)
        batch = self._layout(features, pins)
        psw = features.weights_or_none()
        output = _PooledLookup.apply(self._anchor, psw, self, batch)
        if not torch.is_grad_enabled():
            for pin in pins:
                pin.release()
        return output

    def _layout(self, features: KeyedJaggedTensor, pins: list[Pin]) -> _Batch:
        n = len(self._feature_table)
        stride = features.stride()
        lengths = features.lengths().view(n, stride) if n else features.lengths()
        counts = lengths.sum(dim=1).tolist() if n else []
        by_table: dict[int, list[int]] = {}
        for k, t in enumerate(self._feature_table):
            by_table.setdefault(t, []).append(counts[k])
        per_table = {t: list(torch.split(pins[t].slots, c)) for t, c in by_table.items()}
        weights = features.weights_or_none()
        batch = _Batch(pins=pins, slots=[], offsets=[])
        position = 0
        for k, t in enumerate(self._feature_table):
            batch.slots.append(per_table[t].pop(0))
            batch.offsets.append(torch.cat([lengths.new_zeros(1), torch.cumsum(lengths[k], 0)]))
            batch.weights.append(None if weights is None else weights[position : position + counts[k]])
            position += counts[k]
        return batch

    def _pool(self, batch: _Batch) -> torch.Tensor:
        mode = "mean" if self._mean else "sum"
        pooled = [
            nn.functional.embedding_bag(
                slots,
                self.caches[t].weights,
                offsets,
                mode=mode,
                per_sample_weights=weights,
                include_last_offset=True,
            )
            for slots, offsets, weights, t in zip(
                batch.slots, batch.offsets, batch.weights, self._feature_table, strict=True
            )
        ]
        return torch.cat(pooled, dim=1) if pooled else self._anchor.new_zeros(0, 0)

    def _update(self, batch: _Batch, grad_output: torch.Tensor) -> torch.Tensor | None:
        """The fused optimizer step of one batch; returns the per-sample-weight gradient."""
        grads = torch.split(grad_output, self._dims, dim=1)
        per_table: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        psw_grads = []
        for k, t in enumerate(self._feature_table):
            offsets, slots, weights = batch.offsets[k], batch.slots[k], batch.weights[k]
            lengths = offsets.diff()
            bag_of_id = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
            grad_ids = grads[k][bag_of_id]
            if self._mean:
                grad_ids = grad_ids / lengths[bag_of_id].clamp(min=1).unsqueeze(1).to(grad_ids.dtype)
            if weights is not None:
                psw_grads.append((grad_ids * self.caches[t].weights[slots]).sum(dim=1))
                grad_ids = grad_ids * weights.unsqueeze(1)
            per_table.setdefault(t, []).append((slots, grad_ids))
        for t, parts in per_table.items():
            cache = self.caches[t]
            slots = torch.cat([s for s, _ in parts])
            unique, inverse = torch.unique(slots, return_inverse=True)
            grad = torch.zeros(len(unique), cache.store.dim).index_add_(
                0, inverse, torch.cat([g for _, g in parts])
            )
            weights, state = cache.weights[unique], cache.state[unique]
            self._rule.apply(weights, state, grad)
            cache.weights[unique] = weights
            cache.state[unique] = state
            cache.mark_dirty(unique)
        for pin in batch.pins:
            pin.release()
        return torch.cat(psw_grads) if psw_grads else None

    # -- checkpoints and cache control ---------------------------------------------------------

    def flush(self) -> None:
        """Write every dirty cached row back to its store."""
        for cache in self.caches:
            cache.flush()

    def purge(self) -> None:
        """Drop every cached row (the stores were just overwritten, e.g. by load_state_dict)."""
        for cache in self.caches:
            cache.purge()

    def caches_full(self) -> bool:
        """Whether every table's cache is full (the Prefetch pipeline observes its steps from then
        on: `pipeline.stages.prefetch`)."""
        return all(cache.full for cache in self.caches)

    def state_dict(
        self, destination: dict[str, Any] | None = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        """The full table shards, read from the stores after a flush (torchrec's ShardedTensors)."""
        self.flush()
        weights = [c.store.weights() for c in self.caches]
        return get_state_dict(self._config.embedding_tables, weights, self._pg, destination, prefix)

    def split_embedding_weights(self) -> list[torch.Tensor]:
        self.flush()
        return [c.store.weights() for c in self.caches]

    def named_split_embedding_weights(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ):
        for table, weight in zip(self._config.embedding_tables, self.split_embedding_weights(), strict=True):
            yield f"{prefix}{table.name}.weight", weight

    def named_parameters_by_table(self):
        yield from self._params.items()

    def stats(self) -> dict[str, dict[str, float]]:
        """Counters per table shard: cache (hits, misses, evictions, write-backs, prefetch time)
        and store (rows and bytes read and written, time in reads and writes)."""
        from dataclasses import asdict

        return {c.name: {**asdict(c.stats), **asdict(c.store.stats)} for c in self.caches}


class _PooledLookup(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, anchor: torch.Tensor, psw: torch.Tensor | None, kernel: TieredEmbeddingBag, batch: _Batch
    ):
        ctx.kernel, ctx.batch = kernel, batch
        return kernel._pool(batch)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):
        psw_grad = ctx.kernel._update(ctx.batch, grad_output.contiguous())
        ctx.batch = None
        return None, psw_grad, None, None


def _segments(features: KeyedJaggedTensor, n: int) -> list[torch.Tensor]:
    """The ids of each of the `n` features of `features`."""
    if n == 0:
        return []
    counts = features.lengths().view(n, -1).sum(dim=1).tolist()
    return list(torch.split(features.values(), counts))


def _open_store(options: TieredOptions, name: str, table: Any, state_width: int) -> RowStore:
    path = Path(options.store_dir) / f"{name}.rows"
    shape = (table.local_rows, table.local_cols, state_width)
    if options.store_mode == "open":
        return RowStore.open(path, *shape, cold=options.cold)
    init = functools.partial(_uniform, table.get_weight_init_min(), table.get_weight_init_max())
    return RowStore.create(path, *shape, init, cold=options.cold)


def _uniform(low: float, high: float, block: torch.Tensor) -> None:
    block.uniform_(low, high)
