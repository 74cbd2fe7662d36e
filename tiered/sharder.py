"""Wiring into torchrec: a sharder whose EmbeddingBagCollection puts the tables planned with
`EmbeddingComputeKernel.CUSTOMIZED_KERNEL` on `TieredEmbeddingBag`.

Tables on other kernels in the same collection are left to torchrec. For the tiered tables the
sharded module keeps torchrec's checkpoint format: `state_dict()` holds each table as a
ShardedTensor whose local shards are the stores, mapped from disk after a flush, and
`load_state_dict()` writes the stores and drops the caches.

The pipeline calls `prefetch()` on the sharded module, which reaches `TieredLookup.prefetch` with
the same KeyedJaggedTensor object that forward later receives; the pins are kept under that object
(weakly: a batch dropped before its forward releases its pins) and handed to the kernels in forward.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torchrec.distributed.embedding_lookup import GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import (
    EmbeddingBagCollectionSharder,
    ShardedEmbeddingBagCollection,
)
from torchrec.distributed.types import ShardingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tiered.cache import Pin
from tiered.kernel import TieredEmbeddingBag
from tiered.options import TieredOptions

__all__ = [
    "TIERED",
    "TieredEmbeddingBagCollectionSharder",
    "TieredLookup",
    "TieredShardedEmbeddingBagCollection",
]

TIERED = EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value
"""The compute kernel to name in a plan for a table that should live on disk."""


class TieredLookup(GroupedPooledEmbeddingsLookup):
    """torchrec's grouped lookup, with tiered kernels for the groups planned on the custom kernel."""

    def __init__(self, *args: Any, options: TieredOptions, prefix: str, **kwargs: Any) -> None:
        self._tiered_options, self._tiered_prefix = options, prefix
        super().__init__(*args, **kwargs)
        self._prefetched: dict[int, tuple[weakref.ref, list[list[Pin] | None]]] = {}
        self._handed: list[list[Pin] | None] | None = None

    def _create_embedding_kernel(self, config, device, pg, sharding_type, env) -> nn.Module:
        if config.compute_kernel != EmbeddingComputeKernel.CUSTOMIZED_KERNEL:
            return super()._create_embedding_kernel(config, device, pg, sharding_type, env)
        if device is not None and device.type != "cpu":
            raise ValueError(f"the tiered embedding kernel runs on CPU; this model is on {device}")
        return TieredEmbeddingBag(config, pg, self._tiered_options, prefix=self._tiered_prefix)

    def prefetch(self, sparse_features: KeyedJaggedTensor, forward_stream: Any = None) -> None:
        """Acquire the rows of `sparse_features` in every tiered kernel (the pipeline's prefetch)."""
        groups = sparse_features.split(self._feature_splits)
        pins = [
            op.prefetch(features) if isinstance(op, TieredEmbeddingBag) else None
            for op, features in zip(self._emb_modules, groups, strict=True)
        ]
        key = id(sparse_features)
        self._prefetched[key] = (
            weakref.ref(sparse_features, lambda _: self._prefetched.pop(key, None)),
            pins,
        )

    def release_prefetched(self, sparse_features: KeyedJaggedTensor, *, updated: bool = False) -> None:
        """Unpin the rows `prefetch(sparse_features)` acquired, without a forward; `updated` marks
        them dirty first, as a training step's update would (no-op if nothing was prefetched)."""
        entry = self._prefetched.pop(id(sparse_features), None)
        if entry is None or entry[0]() is not sparse_features:
            return
        for op, pins in zip(self._emb_modules, entry[1], strict=True):
            if pins is None:  # a table on another kernel
                continue
            for cache, pin in zip(op.caches, pins, strict=True):
                if updated and not pin.released:
                    cache.mark_dirty(pin.unique_slots)
                pin.release()

    def forward(self, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        entry = self._prefetched.pop(id(sparse_features), None)
        self._handed = entry[1] if entry is not None and entry[0]() is sparse_features else None
        try:
            return super().forward(sparse_features)
        finally:
            self._handed = None

    def _forward(self, features_by_group: list[KeyedJaggedTensor]) -> list[torch.Tensor]:
        handed = self._handed or [None] * len(self._emb_modules)
        embeddings = []
        for config, op, features, pins, auto in zip(
            self.grouped_configs,
            self._emb_modules,
            features_by_group,
            handed,
            self._feature_score_auto_collections,
            strict=True,
        ):
            features = self._apply_feature_processor_and_gradient_scaling(features, config, auto)
            embeddings.append(op(features, pins) if isinstance(op, TieredEmbeddingBag) else op(features))
        return embeddings

    def tiered_kernels(self) -> list[TieredEmbeddingBag]:
        return [op for op in self._emb_modules if isinstance(op, TieredEmbeddingBag)]


class TieredShardedEmbeddingBagCollection(ShardedEmbeddingBagCollection):
    """torchrec's sharded EBC whose custom-kernel tables live on disk (module docstring)."""

    widens_ids = True
    """Its custom kernel (`TieredEmbeddingBag`) takes int32 ids and lengths as well as int64
    (`RowCache.acquire` widens the ids; the bag offsets are an int64 cumsum): a pipeline may send
    them narrowed. Read from the class, which every rank has alike."""

    def __init__(self, *args: Any, tiered: TieredOptions, **kwargs: Any) -> None:
        self._tiered_options = tiered
        super().__init__(*args, **kwargs)
        # Loading copies into the stores' mapped regions: rows queued for write-back must land
        # before (or they would overwrite the loaded ones), and cached rows are stale after.
        self._register_load_state_dict_pre_hook(lambda *_: self._for_kernels("flush"))
        self.register_load_state_dict_post_hook(lambda *_: self._for_kernels("purge"))

    def _for_kernels(self, method: str) -> None:
        for kernel in self.tiered_kernels():
            getattr(kernel, method)()

    def _create_lookups(self) -> None:
        prefix = f"{(self._module_fqn or 'ebc').replace('.', '_')}."
        for sharding_type, sharding in zip(self._sharding_types, self._embedding_shardings, strict=True):
            configs = getattr(sharding, "_grouped_embedding_configs", [])
            if not any(c.compute_kernel == EmbeddingComputeKernel.CUSTOMIZED_KERNEL for c in configs):
                self._lookups.append(sharding.create_lookup())
                continue
            if sharding_type not in _SUPPORTED:
                supported = ", ".join(sorted(_SUPPORTED))
                raise ValueError(f"the tiered kernel supports {supported} sharding; got {sharding_type}")
            self._lookups.append(
                TieredLookup(
                    grouped_configs=configs,
                    pg=sharding._pg,
                    device=self._device,
                    sharding_type=ShardingType.ROW_WISE
                    if sharding_type == ShardingType.ROW_WISE.value
                    else None,
                    env=sharding._env,
                    options=self._tiered_options,
                    prefix=prefix,
                )
            )

    def _initialize_torch_state(self, skip_registering: bool = False) -> None:
        # torchrec builds checkpoint tensors only for the kernels it knows; ours present their
        # stores exactly as the fused kernel presents its weights.
        with self._tiered_as(EmbeddingComputeKernel.FUSED.value):
            super()._initialize_torch_state(skip_registering)

    def reset_parameters(self) -> None:
        # The stores were initialised when they were created; torchrec skips key-value tables.
        with self._tiered_as(EmbeddingComputeKernel.KEY_VALUE.value):
            super().reset_parameters()

    @contextmanager
    def _tiered_as(self, kernel: str) -> Iterator[None]:
        changed = []
        for sharding in self.module_sharding_plan.values():
            if sharding.compute_kernel == TIERED or getattr(sharding, "_tiered", False):
                changed.append((sharding, sharding.compute_kernel))
                sharding._tiered = True
                sharding.compute_kernel = kernel
        try:
            yield
        finally:
            for sharding, previous in changed:
                sharding.compute_kernel = previous

    def tiered_kernels(self) -> list[TieredEmbeddingBag]:
        """Every tiered kernel of this module on this rank."""
        return [
            k for lookup in self._lookups if isinstance(lookup, TieredLookup) for k in lookup.tiered_kernels()
        ]

    def caches_full(self) -> bool:
        """Whether every tiered table's cache on this rank is full (from then on a prefetch costs
        what it will cost in the steady state: the Prefetch pipeline's watch observes from then)."""
        return all(k.caches_full() for k in self.tiered_kernels())

    def release_prefetched(self, dist_input: list[KeyedJaggedTensor], *, updated: bool = False) -> None:
        """Unpin the rows `prefetch(dist_input)` acquired, without a forward (`TieredLookup`); the
        I/O of a step with no compute, for benchmarks."""
        for features, lookup in zip(dist_input, self._lookups, strict=True):
            if isinstance(lookup, TieredLookup):
                lookup.release_prefetched(features, updated=updated)

    def tiered_stats(self) -> dict[str, dict[str, float]]:
        """Cache and store counters per table shard on this rank (`TieredEmbeddingBag.stats`)."""
        return {name: s for k in self.tiered_kernels() for name, s in k.stats().items()}


_SUPPORTED = {ShardingType.TABLE_WISE.value, ShardingType.COLUMN_WISE.value, ShardingType.ROW_WISE.value}


class TieredEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    """Shards EmbeddingBagCollections; tables planned with `TIERED` live on disk.

    Args:
        options: where the stores live and how large the caches are.
        fused_params: as torchrec's sharder (the optimizer usually comes from
            `apply_optimizer_in_backward`).
    """

    def __init__(
        self, options: TieredOptions, fused_params: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(fused_params=fused_params, **kwargs)
        self._options = options

    def shard(self, module, params, env, device=None, module_fqn=None) -> TieredShardedEmbeddingBagCollection:
        return TieredShardedEmbeddingBagCollection(
            module=module,
            table_name_to_parameter_sharding=params,
            env=env,
            fused_params=self.fused_params,
            device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            module_fqn=module_fqn,
            sharded_module_order_overwrite=self._sharded_module_order_overwrite,
            tiered=self._options,
        )

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        kernels = super().compute_kernels(sharding_type, compute_device_type)
        if sharding_type in _SUPPORTED and compute_device_type == "cpu":
            kernels.append(TIERED)
        return kernels
