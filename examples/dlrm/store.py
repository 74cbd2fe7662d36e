"""Tables on disk: `--embedding-store DIR --cache-rows N` puts every table on the `tiered` kernel.

This module turns the flags into the tiered sharder and a hand-built plan (torchrec's planner has no
cost model for a customized kernel and refuses it), checks before the first step that the cache is
large enough and that an existing store was written by as many ranks as this run has, turns the
kernel's errors into `InputError`s that say what to do, and adds the cache's figures to the summary.
The `tiered` package is imported only when a store is asked for, so runs without one never load it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.types import ModuleSharder, ShardingPlan

from examples.dlrm.config import InputError, TrainConfig
from examples.dlrm.runners import Runner

__all__ = [
    "BATCHES_IN_FLIGHT",
    "cache_rows_needed",
    "cache_summary",
    "check_cache_rows",
    "check_store_dir",
    "check_store_world",
    "guard_cache",
    "store_errors",
    "tiered_plan",
]

BATCHES_IN_FLIGHT = {"none": 1, "base": 1, "sparse-dist": 1, "prefetch": 2}
"""Per `--pipeline`, the most training batches whose rows are pinned in the cache at once: the plain
loop, Base and SparseDist make a batch's rows resident inside its forward and release them after its
update; Prefetch makes the next batch's resident during this one's backward. With `--eval-every`,
one eval batch more: an eval pass runs while the training batches in flight keep their pins."""

_STORE_FILE = re.compile(r"\.r(\d+)\.row\d+\.col\d+\.rows$")  # tiered.kernel's shard file names


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


def check_store_world(config: TrainConfig, *, world_size: int) -> None:
    """Check, before any collective, that the store files in `config.embedding_store` were written
    by `world_size` ranks: each file is one rank's shard of a table, so a store opens only at the
    world size that wrote it.

    Raises:
        InputError: the files name other ranks than this run has.
    """
    assert config.embedding_store is not None
    ranks = {
        int(m.group(1)) for p in Path(config.embedding_store).iterdir() if (m := _STORE_FILE.search(p.name))
    }
    if not ranks or ranks == set(range(world_size)):
        return
    written = max(ranks) + 1
    replace = "replaces" if config.store_mode == "create" else "would replace"
    raise InputError(
        f"--embedding-store {config.embedding_store} was written by {written} rank(s) and this run has "
        f"{world_size}: its files are per-rank shards, which open only at the world size that wrote them. "
        f"Run with {written} rank(s) (torchrun --nproc_per_node={written}), or give this run another "
        "directory and move the trained rows into it through a checkpoint (the model's state_dict). "
        f"--store-mode create in this directory {replace} the trained rows with initial weights.",
        every_rank=True,
    )


def batches_in_flight(config: TrainConfig) -> int:
    """The most batches whose rows are pinned in a table shard's cache at once (see
    `BATCHES_IN_FLIGHT`)."""
    return BATCHES_IN_FLIGHT[config.pipeline] + (1 if config.eval_every else 0)


def cache_rows_needed(config: TrainConfig) -> int:
    """The `--cache-rows` that no batch of this run can exceed, whatever its ids.

    A table shard receives every id of its feature in the global batch (table-wise and column-wise
    alike), at most `--batch-size` times the most ids a sample has per feature (1 for Criteo TSV,
    2 * pooling - 1 for synthetic data); the batches in flight multiply that, and a shard's own row
    count caps it. The largest table decides.
    """
    from tiered.cache import rows_needed

    per_sample = 1 if config.data is not None else 2 * config.pooling - 1
    return max(
        rows_needed(
            distinct_rows_per_batch=config.batch_size * per_sample,
            batches_in_flight=batches_in_flight(config),
            shard_rows=rows,
        )
        for rows in config.table_sizes
    )


def check_cache_rows(config: TrainConfig) -> None:
    """Check, before the first step, that `--cache-rows` holds every batch in flight.

    Raises:
        InputError: it is below `cache_rows_needed(config)`; the message gives that number.
    """
    if config.cache_rows is not None and config.cache_rows < cache_rows_needed(config):
        raise InputError(_cache_advice(config), every_rank=True)


def _cache_advice(config: TrainConfig) -> str:
    depth = batches_in_flight(config)
    per_sample = "1 id" if config.data is not None else f"up to {2 * config.pooling - 1} ids"
    plain = cache_rows_needed(_replace(config, pipeline="none", eval_every=0))
    return (
        f"--cache-rows {config.cache_rows} is too small: a batch can ask a table shard for "
        f"--batch-size {config.batch_size} x {per_sample} per feature distinct rows, and "
        f"--pipeline {config.pipeline} keeps {depth} batch(es) in the cache at once"
        f"{' (one of them an eval batch, with --eval-every)' if config.eval_every else ''}. "
        f"Use --cache-rows {cache_rows_needed(config)} or more, or lower --batch-size; "
        f"--pipeline sparse-dist keeps one batch and needs {plain}."
    )


def _replace(config: TrainConfig, **changes: Any) -> TrainConfig:
    from dataclasses import replace

    return replace(config, **changes)


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
    """A runner whose too-small-cache error becomes an `InputError` naming `--cache-rows` (the
    preflight check makes it unreachable unless `BATCHES_IN_FLIGHT` is wrong)."""

    def __init__(self, runner: Runner, config: TrainConfig) -> None:
        self.runner = runner
        """The runner it guards (a pipeline: its schedule and rewrite report are read from it)."""
        self._config = config

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        from tiered import CacheTooSmallError

        try:
            return self.runner.progress(dataloader_iter)
        except CacheTooSmallError as e:
            raise InputError(f"{_cache_advice(self._config)} (The kernel said: {e})") from e

    def dataloader_state(self, dataloader_iter: Iterator[Any]) -> Any:
        return self.runner.dataloader_state(dataloader_iter)


def guard_cache(runner: Runner, config: TrainConfig) -> Runner:
    """`runner`, translating the kernel's CacheTooSmallError into an `InputError`."""
    assert config.cache_rows is not None
    return _GuardedRunner(runner, config)


def cache_summary(model: nn.Module, device: torch.device) -> dict[str, float]:
    """`cache_hit_rate` over every table shard of every rank, `prefetch_ms` (per batch: the time one
    rank spends making a batch's rows resident in all its table shards, averaged over the ranks;
    under the Prefetch pipeline it is spent on the worker thread, mostly hidden behind backward) and
    `store_read_ms` (its share reading the disk, same units). A collective: every rank must call it."""
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
