"""Tables on disk: `--embedding-store DIR --cache-rows N` puts every table on the `tiered` kernel.

This module turns the flags into the tiered sharder and a hand-built plan (torchrec's planner has no
cost model for a customized kernel and refuses it), turns the kernel's errors into `InputError`s that
say what to do, and adds the cache's figures to the summary. The `tiered` package is imported only
when a store is asked for, so runs without one never load it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.types import ModuleSharder, ShardingPlan

from examples.dlrm.config import InputError, TrainConfig
from examples.dlrm.runners import Runner

__all__ = ["cache_summary", "check_store_dir", "guard_cache", "store_errors", "tiered_plan"]


def check_store_dir(directory: str) -> None:
    """Check, before any collective, that the store directory exists and is writable.

    Raises:
        InputError: it is missing, not a directory, or not writable.
    """
    path = Path(directory)
    if not path.exists():
        raise InputError(
            f"--embedding-store {directory} does not exist; create it (mkdir -p) or pick another"
        )
    if not path.is_dir():
        raise InputError(f"--embedding-store {directory} is not a directory; pick a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise InputError(f"--embedding-store {directory} is not writable; pick a writable directory")


def tiered_plan(
    module: nn.Module, fqn: str, config: TrainConfig, *, world_size: int, sharding: tuple[str, ...]
) -> tuple[ShardingPlan, ModuleSharder]:
    """The plan putting every table of the EmbeddingBagCollection `module` (at `fqn`) on the tiered
    kernel, and the sharder that builds it.

    Tables are table-wise, round-robin over the ranks; column-wise over all ranks when `sharding`
    allows column-wise only.

    Raises:
        InputError: the store directory or cache size is refused by the kernel's options.
    """
    from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, table_wise

    from tiered import TIERED, TieredEmbeddingBagCollectionSharder, TieredOptions

    try:
        options = TieredOptions(
            store_dir=config.embedding_store,
            cache_rows=config.cache_rows,
            store_mode=config.store_mode,
            cold=config.cold_store,
        )
    except ValueError as e:
        raise InputError(str(e)) from e
    sharder = TieredEmbeddingBagCollectionSharder(options)
    tables = [table.name for table in module.embedding_bag_configs()]
    by_column = "table_wise" not in sharding
    per_table = {
        table: column_wise(ranks=list(range(world_size)), compute_kernel=TIERED)
        if by_column
        else table_wise(rank=i % world_size, compute_kernel=TIERED)
        for i, table in enumerate(tables)
    }
    module_plan = construct_module_sharding_plan(
        module, per_param_sharding=per_table, sharder=sharder, world_size=world_size, device_type="cpu"
    )
    return ShardingPlan({fqn: module_plan}), sharder


def store_errors() -> tuple[type[Exception], ...]:
    """The exceptions the tiered kernel raises for a store it cannot create or open."""
    from tiered import StoreError

    return (StoreError,)


class _GuardedRunner:
    """A runner whose too-small-cache error becomes an `InputError` naming `--cache-rows`."""

    def __init__(self, runner: Runner, cache_rows: int) -> None:
        self._runner = runner
        self._cache_rows = cache_rows

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        from tiered import CacheTooSmallError

        try:
            return self._runner.progress(dataloader_iter)
        except CacheTooSmallError as e:
            raise InputError(
                f"--cache-rows {self._cache_rows} is too small for one batch's rows: {e} "
                "Raise --cache-rows or lower --batch-size."
            ) from e

    def dataloader_state(self, dataloader_iter: Iterator[Any]) -> Any:
        return self._runner.dataloader_state(dataloader_iter)


def guard_cache(runner: Runner, config: TrainConfig) -> Runner:
    """`runner`, translating the kernel's CacheTooSmallError (first batch) into an `InputError`."""
    assert config.cache_rows is not None
    return _GuardedRunner(runner, config.cache_rows)


def cache_summary(model: nn.Module, device: torch.device) -> dict[str, float]:
    """`cache_hit_rate` over every table shard of every rank, `prefetch_ms` (mean time to make one
    batch's rows resident, per rank, averaged over ranks; under the Prefetch pipeline it is spent on
    the worker thread, mostly hidden behind backward) and `store_read_ms` (its share reading the
    disk). A collective: every rank must call it."""
    stats = [s for m in model.modules() if hasattr(m, "tiered_stats") for s in m.tiered_stats().values()]
    hits = sum(s["hits"] for s in stats)
    misses = sum(s["misses"] for s in stats)
    batches = max((s["prefetches"] for s in stats), default=0)
    prefetch = sum(s["prefetch_seconds"] for s in stats) / max(batches, 1)
    read = sum(s["read_seconds"] for s in stats) / max(batches, 1)
    totals = torch.tensor([hits, misses, prefetch, read], dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    hits, misses, prefetch, read = totals.tolist()
    world = dist.get_world_size()
    return {
        "cache_hit_rate": round(hits / max(hits + misses, 1), 4),
        "prefetch_ms": round(1000 * prefetch / world, 3),
        "store_read_ms": round(1000 * read / world, 3),
    }
