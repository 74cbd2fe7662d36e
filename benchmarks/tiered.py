"""`python -m benchmarks tiered`: tables on disk, at world size 1 and 2, against the bound.

Each config keeps every table on the `tiered` kernel with a cold store (every miss reads the disk).
In the same runs, on the same batches: the plain loop, our SparseDist and Prefetch, and Prefetch's
bound (`benchmarks.bound`): I/O alone (the prefetch of the same batches with no compute) and compute
alone (every row cached, no collective). A pipeline that overlaps the two cannot beat the larger, so
Prefetch's step over max(I/O alone, compute alone), paired within each round, is its distance to the
bound. At world size 1 a core is free for the prefetch thread. Per config and world size: the step
times, that distance, Prefetch over the plain loop, process CPU per step and the hit rate; and, once,
what a cold 4 KiB read costs in the stores' folder (`benchmarks.disk`), so that the figures are read
with their machine.
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.configs import TIERED_CONFIGS
from benchmarks.disk import read_cost_line
from benchmarks.report import by_round, cell, over_rounds, paired, publish
from benchmarks.run import run_benchmark
from benchmarks.spec import RunSpec

__all__ = ["VARIANTS", "tiered"]

PF = "ours-prefetch"
VARIANTS = ("plain", "ours-sparse-dist", PF, "io-alone", "compute-alone")


def tiered(*, configs: list[str], world_sizes: list[int], steps: int, warmup: int, rounds: int, seed: int,
           timeout: float, store_dir: str, json: str | None, md: str | None,
           command: str) -> int:  # fmt: skip
    """The `tiered` subcommand: every world size in turn, then one table."""
    disk = read_cost_line(store_dir)  # before the runs, on a quiet machine
    print(f"[bench] {disk}", flush=True)
    results = []
    for world_size in world_sizes:
        spec = RunSpec(configs=tuple(configs or TIERED_CONFIGS), variants=VARIANTS, steps=steps,
                       warmup=warmup, auto_warmup=warmup, rounds=rounds, profile_steps=0, seed=seed,
                       store_dir=store_dir)  # fmt: skip
        results.append(
            run_benchmark(spec, world_size=world_size, link=None, timeout=timeout, command=command)
        )
    meta = {**results[0]["meta"], "where": f"world sizes {', '.join(map(str, world_sizes))}, loopback"}
    note = ("ms: median over rounds of each run's median step. CPU: process CPU ms per step of plain / "
            "Prefetch / I/O alone / compute alone, the busiest rank. Hit rate: Prefetch's.")  # fmt: skip
    publish({"meta": meta, "world_sizes": results}, meta, "Tables on disk: Prefetch against its bound",
            *table(results), [note, disk], json_path=json, md_path=md)  # fmt: skip
    return 0


def distance(steps: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    """`steps` with each round's bound added: max(I/O alone, compute alone) of that round."""
    halves = {"io-alone", "compute-alone"}
    return {k: {**r, "bound": max(r[h] for h in halves)} if halves <= set(r) else r for k, r in steps.items()}


def table(results: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """One line per world size and config."""
    columns = ["ranks / config", "plain ms", "SparseDist ms", "Prefetch ms", "I/O alone ms",
               "compute alone ms", "Prefetch / bound", "Prefetch / plain", "CPU ms/step",
               "hit rate"]  # fmt: skip
    cells = []
    for result in results:
        for config in dict.fromkeys(r["config"] for r in result["runs"]):
            runs = [r for r in result["runs"] if r["config"] == config]
            steps = distance(by_round(runs, "step_ms"))
            cpu = by_round(runs, "cpu_ms")
            hit = over_rounds(
                [r["cache_hit_rate"] for r in runs if r["variant"] == PF and "cache_hit_rate" in r]
            )
            cells.append([
                f"{result['meta']['world_size']} / {config}", *(_ms(steps, v) for v in VARIANTS),
                cell(paired(steps, PF, "bound"), ".2f"), cell(paired(steps, PF, "plain"), ".2f"),
                " / ".join(_ms(cpu, v) or "-" for v in ("plain", PF, "io-alone", "compute-alone")),
                f"{hit.median:.3f}" if hit else None,
            ])  # fmt: skip
    return columns, cells


def _ms(rounds: dict[int, dict[str, float]], variant: str) -> str | None:
    values = [r[variant] for r in rounds.values() if variant in r]
    return f"{statistics.median(values):.1f}" if values else None
