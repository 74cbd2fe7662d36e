"""Hit rate of each cache policy on a config's id stream, against Belady's optimum (issue 25).

`python -m benchmarks.hit_rates [--config tiered-skewed] [--batches 1500] [--skip 500]` replays the
ids one rank's tables receive (`benchmarks.model.make_batches`, one rank) through a `tiered.RowCache`
per table with each policy of `tiered.POLICIES`, over a store that holds nothing (no disk I/O: only
the bookkeeping runs), in the Prefetch pipeline's order: batch i+1 is acquired while batch i is
still pinned. Belady's MIN is computed offline on the same stream under the same rule: to load a
batch's misses it evicts the cached rows whose next request is farthest ahead, never a row of the
batch being loaded or of the one still in flight. No online policy can miss less on this stream
(with a batch's rows all resident at once, MIN is optimal up to the order within a batch).

Hits and misses count once per distinct row per batch, as `tiered.CacheStats` does, over batches
`skip` to `batches` (the caches are full by then). Prints a Markdown table; `--json` writes it too.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from pathlib import Path

import numpy as np
import torch

from benchmarks.configs import get_config
from benchmarks.model import make_batches
from tiered import POLICIES, RowCache, make_policy

__all__ = ["belady_hits", "id_streams", "main", "policy_hits"]


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


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    config = get_config(args.config)
    if not 0 <= args.skip < args.batches:
        print("hit_rates: --skip must be at least 0 and below --batches", file=sys.stderr)
        return 2
    if config.cache_fraction is None:
        print(f"hit_rates: {args.config} keeps its tables in RAM; pick a config on disk", file=sys.stderr)
        return 2
    fractions = args.fractions or [config.cache_fraction]
    streams = id_streams(args.config, args.batches, seed=args.seed)[: args.tables]
    result: dict[str, dict[str, float]] = {}
    for fraction in fractions:
        capacity = max(1, int(config.num_embeddings * fraction))
        column = {}
        for name in [*POLICIES, "belady"]:
            totals = np.zeros(2)
            for stream in streams:
                if name == "belady":
                    totals += belady_hits(stream, capacity, args.skip)
                else:
                    totals += policy_hits(stream, config.num_embeddings, capacity, name, args.skip)
            column[name] = float(totals[0] / totals.sum())
        result[f"{fraction:g}"] = column
    print(_markdown(config.name, result, args))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "hit_rate": result}, indent=1))
    return 0


def _markdown(config: str, result: dict[str, dict[str, float]], args: argparse.Namespace) -> str:
    fractions = list(result)
    lines = [
        f"Hit rate on `{config}` ({args.tables} tables, batches {args.skip}-{args.batches}, "
        f"seed {args.seed}):",
        "",
        "| policy | " + " | ".join(f"{f} cached" for f in fractions) + " |",
        "|---|" + "---:|" * len(fractions),
    ]
    for name in result[fractions[0]]:
        cells = [f"{result[f][name]:.3f}" for f in fractions]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    best = {f: max((v, n) for n, v in result[f].items() if n != "belady") for f in fractions}
    lines += ["", *(f"- {f} cached: best policy {n} at {v / result[f]['belady']:.3f} of Belady's "
                    f"({result[f]['belady'] - v:.3f} below)" for f, (v, n) in best.items())]  # fmt: skip
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.hit_rates", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiered-skewed", help="a config with tables on disk")
    p.add_argument("--batches", type=int, default=1500, help="batches replayed (default 1500)")
    p.add_argument("--skip", type=int, default=500, help="batches before the counted ones (default 500)")
    p.add_argument("--tables", type=int, default=8, help="tables replayed (default 8)")
    p.add_argument("--fractions", type=float, nargs="+", help="cache sizes (default: the config's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the table here")
    return p


if __name__ == "__main__":
    sys.exit(main())
