"""The bound of the Prefetch pipeline with tables on disk: I/O alone and compute alone (issue 25).

A pipeline that overlaps the prefetch of batch i+1 with the compute of batch i cannot take less than
the larger of the two, so its step over `max(io-alone, compute-alone)` is its distance to the bound:

- `io_alone`: the prefetch of the same batches with no forward or backward: each batch's rows (the
  ids this rank's shards receive, replayed from `benchmarks.bound.capture`) made resident, marked
  updated and released, as a training step would leave them, so that evictions write them back
  behind as in training. One thread, one batch after the other.
- compute alone (`benchmarks.bound.compute_alone`) on a model whose caches hold every row:
  `bound_config` gives the config with the whole table cached, and `warm` reads every row into the
  caches before the timed steps, so no step touches the disk.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from benchmarks import bound
from benchmarks.configs import BenchConfig

__all__ = ["bound_config", "io_alone", "warm"]

_WARM_CHUNK = 65_536  # rows read into a cache at a time while warming


def _tiered_modules(model: nn.Module) -> dict[str, Any]:
    from tiered import TieredShardedEmbeddingBagCollection

    inner = bound.inner_model(model)
    return {n: m for n, m in inner.named_modules() if isinstance(m, TieredShardedEmbeddingBagCollection)}


def bound_config(config: BenchConfig, variant: str) -> BenchConfig:
    """The config `variant` builds its model from: `compute-alone` on tables on disk caches them whole."""
    if variant == "compute-alone" and config.cache_fraction is not None:
        return replace(config, cache_fraction=1.0)
    return config


def warm(model: nn.Module) -> None:
    """Read every row of every tiered table of `model` into its cache (which must hold them all)."""
    for ebc in _tiered_modules(model).values():
        for kernel in ebc.tiered_kernels():
            for cache in kernel.caches:
                if cache.capacity < cache.store.rows:
                    raise ValueError(f"{cache.name}: {cache.capacity} slots, {cache.store.rows} rows")
                for start in range(0, cache.store.rows, _WARM_CHUNK):
                    stop = min(start + _WARM_CHUNK, cache.store.rows)
                    cache.acquire(torch.arange(start, stop)).release()


def io_alone(model: nn.Module, captured: bound.Captured) -> Callable[[Iterator[Any]], Any]:
    """A step function: the prefetch of the next captured batch alone (module docstring)."""
    modules = _tiered_modules(model)
    if not modules:
        raise ValueError("io-alone needs tables on disk: run it on a config with cache_fraction")
    position = [0]

    def step(batches: Iterator[Any]) -> Any:
        if position[0] >= len(captured.batches):
            raise StopIteration
        next(batches)
        received = captured.batches[position[0]]
        with torch.no_grad():
            for name, ebc in modules.items():
                dist_input = received[name].dist_input
                ebc.prefetch(dist_input=dist_input)
                ebc.release_prefetched(dist_input, updated=True)
        position[0] += 1
        return None

    return step
