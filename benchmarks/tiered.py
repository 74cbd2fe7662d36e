"""`python -m benchmarks tiered`: tables on disk, at world size 1 and 2, against the bound.

Each config keeps every table on the `tiered` kernel with a cold store (every miss reads the disk).
In the same runs, on the same batches: the plain loop, our SparseDist and Prefetch, and Prefetch's
bound (`benchmarks.bound`): I/O alone (the prefetch of the same batches with no compute) and compute
alone (every row cached, no collective). A pipeline that overlaps the two cannot beat the larger, so
Prefetch's step over max(I/O alone, compute alone), paired within each round, is its distance to the
bound. At world size 1 a core is free for the prefetch thread. Per config and world size: the step
times, that distance, Prefetch over the plain loop, process CPU per step and the hit rate; and, once,
what a cold 4 KiB read costs in the stores' folder (`benchmarks.measure.read_cost`).
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.configs import TIERED_CONFIGS
from benchmarks.measure import read_cost_line
from benchmarks.report import by_round, cell, paired, publish
from benchmarks.run import run_benchmark
from benchmarks.spec import RunSpec

__all__ = ["VARIANTS", "tiered"]

PF = "ours-prefetch"
VARIANTS = ("plain", "ours-sparse-dist", PF, "io-alone", "compute-alone")


def tiered(
    *,
    configs: list[str],
    world_sizes: list[int],
    timeout: float,
    json: str | None,
    md: str | None,
    command: str,
    **fields: Any,
) -> int:
    """The `tiered` subcommand: every world size in turn, then one table. `fields`: the `RunSpec`'s
    steps, warm-up, rounds, seed and store folder."""
    disk = read_cost_line(fields["store_dir"])  # before the runs, on a quiet machine
    print(f"[bench] {disk}", flush=True)
    names = tuple(configs or TIERED_CONFIGS)
    spec = RunSpec(configs=names, variants=VARIANTS, auto_warmup=fields["warmup"], profile_steps=0, **fields)
    results = [
        run_benchmark(spec, world_size=w, link=None, timeout=timeout, command=command) for w in world_sizes
    ]
    meta = {**results[0]["meta"], "where": f"world sizes {', '.join(map(str, world_sizes))}, loopback"}
    note = (
        "ms: median over rounds of each run's median step. CPU: process CPU ms per step of plain / "
        "Prefetch / I/O alone / compute alone, the busiest rank. Hit rate: Prefetch's."
    )
    title, result = "Tables on disk: Prefetch against its bound", {"meta": meta, "world_sizes": results}
    publish(result, title, *table(results), [note, disk], json_path=json, md_path=md)
    return 0


def distance(steps: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    """`steps` with each round's bound added: max(I/O alone, compute alone) of that round."""
    halves = {"io-alone", "compute-alone"}
    return {k: {**r, "bound": max(r[h] for h in halves)} if halves <= set(r) else r for k, r in steps.items()}


def table(results: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """One line per world size and config."""
    columns = (
        "ranks / config|plain ms|SparseDist ms|Prefetch ms|I/O alone ms|compute alone ms|Prefetch / bound|"
        "Prefetch / plain|CPU ms/step|hit rate"
    ).split("|")
    cells = []
    for result in results:
        for config in dict.fromkeys(r["config"] for r in result["runs"]):
            runs = [r for r in result["runs"] if r["config"] == config]
            steps = distance(by_round(runs, "step_ms"))
            cpu = by_round(runs, "cpu_ms")
            hits = [r["cache_hit_rate"] for r in runs if r["variant"] == PF and "cache_hit_rate" in r]
            ratios = (cell(paired(steps, PF, "bound"), ".2f"), cell(paired(steps, PF, "plain"), ".2f"))
            cpu_ms = " / ".join(_ms(cpu, v) or "-" for v in ("plain", PF, "io-alone", "compute-alone"))
            hit = f"{statistics.median(hits):.3f}" if hits else None
            where = f"{result['meta']['world_size']} / {config}"
            cells.append([where, *(_ms(steps, v) for v in VARIANTS), *ratios, cpu_ms, hit])
    return columns, cells


def _ms(rounds: dict[int, dict[str, float]], variant: str) -> str | None:
    values = [r[variant] for r in rounds.values() if variant in r]
    return f"{statistics.median(values):.1f}" if values else None
