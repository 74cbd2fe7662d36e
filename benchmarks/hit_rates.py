"""`python -m benchmarks hit-rates`: each cache policy's hit rate on a config's ids, against Belady's optimum.

`hit-rates [--config tiered-skewed] [--batches 1500] [--skip 500] [--fractions ...]` replays the
ids one rank's tables receive (`benchmarks.models.make_batches`, one rank) through a `tiered.RowCache`
per table with each policy of `tiered.POLICIES`, over a store that holds nothing (no disk I/O: only
the bookkeeping runs), in the Prefetch pipeline's order: batch i+1 is acquired while batch i is
still pinned. Belady's MIN is computed offline on the same stream under the same rule: to load a
batch's misses it evicts the cached rows whose next request is farthest ahead, never a row of the
batch being loaded or of the one still in flight. No online policy can miss less on this stream
(with a batch's rows all resident at once, MIN is optimal up to the order within a batch).

Hits and misses count once per distinct row per batch, as `tiered.CacheStats` does, over batches
`skip` to `batches` (the caches are full by then). Prints the table; `--md`/`--json` write it.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from benchmarks.configs import get_config
from benchmarks.measure import machine
from benchmarks.models import make_batches
from benchmarks.report import publish
from tiered import POLICIES, RowCache, make_policy

__all__ = ["belady_hits", "hit_rates", "id_streams", "policy_hits"]


class _NoStore:
    """A store with rows but no bytes: reads give empty rows, writes are dropped."""

    dim = state_width = 0

    def __init__(self, rows: int) -> None:
        self.rows = rows

    def read(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(len(rows), 0), torch.zeros(len(rows), 0)

    def write(self, rows: torch.Tensor, weights: torch.Tensor, state: torch.Tensor) -> None:
        pass


def id_streams(config_name: str, batches: int, *, seed: int = 0) -> list[list[np.ndarray]]:
    """Per table, the sorted distinct ids of each batch one rank's table receives (world size 1)."""
    config = get_config(config_name)
    streams: list[list[np.ndarray]] = [[] for _ in range(config.num_tables)]
    for batch in make_batches(config, count=batches, rank=0, seed=seed):
        kjt = batch.sparse_features
        counts = kjt.lengths().view(config.num_tables, -1).sum(dim=1).tolist()
        for table, ids in enumerate(torch.split(kjt.values(), counts)):
            streams[table].append(np.unique(ids.numpy()))
    return streams


def policy_hits(
    stream: list[np.ndarray], rows: int, capacity: int, policy: str, skip: int
) -> tuple[int, int]:
    """(hits, misses) of a `RowCache` with `policy` over `stream`, batches from `skip` on."""
    cache = RowCache(_NoStore(rows), capacity, make_policy(policy, capacity, rows), name=policy)  # type: ignore[arg-type]
    held = None
    for index, ids in enumerate(stream):
        if index == skip:
            before = (cache.stats.hits, cache.stats.misses)
        pin = cache.acquire(torch.from_numpy(ids))
        if held is not None:
            held.release()
        held = pin
    return cache.stats.hits - before[0], cache.stats.misses - before[1]


def belady_hits(stream: list[np.ndarray], capacity: int, skip: int) -> tuple[int, int]:
    """(hits, misses) of Belady's MIN over `stream` with two batches pinned (module docstring)."""
    never = len(stream)
    next_use: list[list[int]] = [[] for _ in stream]
    last: dict[int, int] = {}
    for index in range(len(stream) - 1, -1, -1):
        ids = stream[index].tolist()
        next_use[index] = [last.get(row, never) for row in ids]
        for row in ids:
            last[row] = index
    cached: dict[int, int] = {}  # row -> index of its next request
    heap: list[tuple[int, int]] = []  # (-next request, row); stale entries skipped
    hits = misses = 0
    previous: set[int] = set()
    for index, ids in enumerate(stream):
        rows = ids.tolist()
        found = sum(row in cached for row in rows)
        if index >= skip:
            hits, misses = hits + found, misses + len(rows) - found
        for row, upcoming in zip(rows, next_use[index], strict=True):
            cached[row] = upcoming
            heapq.heappush(heap, (-upcoming, row))
        pinned, kept = previous | set(rows), []
        while len(cached) > capacity:
            upcoming, row = heapq.heappop(heap)
            if cached.get(row) != -upcoming:
                continue
            if row in pinned:
                kept.append((upcoming, row))
                continue
            del cached[row]
        for entry in kept:
            heapq.heappush(heap, entry)
        previous = set(rows)
    return hits, misses


def hit_rates(
    *,
    config: str,
    batches: int,
    skip: int,
    tables: int,
    fractions: list[float],
    seed: int,
    json: str | None,
    md: str | None,
    command: str,
) -> int:
    """The `hit-rates` subcommand: the hit rate of every policy and of Belady's MIN per cache size."""
    chosen = get_config(config)
    if not 0 <= skip < batches:
        raise ValueError("--skip must be at least 0 and below --batches")
    if chosen.cache_fraction is None:
        raise ValueError(f"{config} keeps its tables in RAM; pick a config on disk (tiered, tiered-skewed)")
    streams = id_streams(config, batches, seed=seed)[:tables]
    result: dict[str, dict[str, float]] = {}
    for fraction in fractions or [chosen.cache_fraction]:
        capacity = max(1, int(chosen.num_embeddings * fraction))
        column = {}
        for name in [*POLICIES, "belady"]:
            totals = np.zeros(2)
            for stream in streams:
                if name == "belady":
                    totals += belady_hits(stream, capacity, skip)
                else:
                    totals += policy_hits(stream, chosen.num_embeddings, capacity, name, skip)
            column[name] = float(totals[0] / totals.sum())
        result[f"{fraction:g}"] = column
    meta = {"command": command, "machine": f"{machine()} (offline, deterministic: no rounds, no spread)"}
    rows = [[name, *(f"{column[name]:.3f}" for column in result.values())] for name in [*POLICIES, "belady"]]
    notes = [f"hit rate on {config}: {len(streams)} tables, batches {skip}-{batches}, seed {seed}"]
    for f, column in result.items():
        value, name = max((v, n) for n, v in column.items() if n != "belady")
        best = f"the best policy, {name}, is at {value / column['belady']:.3f} of Belady's"
        notes.append(f"{f} cached: {best} ({column['belady'] - value:.3f} below)")
    columns = ["policy", *(f"{f} cached" for f in result)]
    out = {"meta": meta, "config": config, "hit_rate": result}
    publish(out, "Cache hit rates", columns, rows, notes, json_path=json, md_path=md)
    return 0
