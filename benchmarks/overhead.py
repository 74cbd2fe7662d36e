"""`python -m benchmarks overhead`: what a step costs where there is nothing to hide.

Every loop trains the `tiny` config (4 tables of 1,000 rows x 8, batch 64, one linear layer), so
whatever a pipeline adds over the plain loop is its host overhead. Runs are `run`'s (paired rounds,
order rotated, a fresh model per run); the figures are per step: wall time (the mean over the run's
steps) and process CPU time (every thread: gloo's and the pipeline's too, the steadier figure), each
over the plain loop's as a paired difference, and our overhead over torchrec's same class. At world
size 2 the slower rank's figures. `--cprofile VARIANT` instead runs that loop once under cProfile on
rank 0 and prints where its time goes, function by function.

`--configs tiny tiny-split tiny-built tiny-shared` adds the tiny model written the ways users write
models (its KJT split, built or shared inside forward, which the pipelines replay on the data path):
each config's own rows, then each loop's CPU per step on that model over the same loop's on `tiny`.
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.report import by_round, cell, header, markdown_table, paired_difference, publish
from benchmarks.run import run_benchmark
from benchmarks.spec import RunSpec

__all__ = ["VARIANTS", "overhead"]

VARIANTS = ("plain", "ours-base", "ours-sparse-dist", "ours-prefetch", "ours-fused-sparse-dist")
VARIANTS += ("torchrec-base", "torchrec-sparse-dist")


def overhead(
    *,
    world_size: int,
    variants: list[str],
    configs: list[str],
    timeout: float,
    cprofile: str | None,
    top: int,
    sort: str,
    only: list[str],
    json: str | None,
    md: str | None,
    command: str,
    **fields: Any,
) -> int:
    """The `overhead` subcommand: print (and write) the table, or the cProfile rows of one loop.
    `fields`: the `RunSpec`'s steps, warm-up, rounds and seed."""
    chosen = tuple(dict.fromkeys(["plain", *(variants or VARIANTS)])) if not cprofile else (cprofile,)
    if cprofile:
        fields.update(rounds=1, cprofile=cprofile)
    names = tuple(configs or ("tiny",))
    spec = RunSpec(configs=names, variants=chosen, auto_warmup=fields["warmup"], profile_steps=0, **fields)
    result = run_benchmark(spec, world_size=world_size, link=None, timeout=timeout, command=command)
    if cprofile:
        print("\n".join(["", *header(result["meta"]), "", *functions(result["runs"], top, sort, only)]))
        return 0
    publish(result, "What a step costs", *table(result["runs"]), json_path=json, md_path=md)
    return 0


def table(runs: list[dict[str, Any]]) -> tuple[list[str], list[list[str]], list[str]]:
    """Per config and loop: wall and CPU ms per step, each over plain (paired); then ours over
    torchrec's, and each loop on a config over the same loop on `tiny`."""
    columns = ["config", "loop", "wall ms/step", "CPU ms/step", "CPU over plain", "wall over plain", "sites"]
    cells, notes, cpu_of = [], [], {}
    for config in dict.fromkeys(r["config"] for r in runs):
        mine = [r for r in runs if r["config"] == config]
        more, over = _config_rows(config, mine)
        cells += more
        cpu_of[config] = {row[1]: float(row[3]) for row in more}
        notes += [
            f"{config} / {r['variant']}: {r['message']}"
            for r in mine
            if r["status"] != "ok" and r["round"] == 0
        ]
        for ours, theirs in (("ours-base", "torchrec-base"), ("ours-sparse-dist", "torchrec-sparse-dist")):
            a, b = over.get(ours), over.get(theirs)
            if a is not None and b is not None and b.median > 0:
                what = f"{config}: our {ours[5:]}'s CPU over plain / torchrec's {theirs[9:]}'s"
                notes.append(f"{what}: {a.median / b.median:.2f} (ratio of the medians)")
    for config in (c for c in cpu_of if c != "tiny" and "tiny" in cpu_of):
        ratios = [
            f"{v} {cpu / cpu_of['tiny'][v]:.3f}" for v, cpu in cpu_of[config].items() if v in cpu_of["tiny"]
        ]
        notes.append(f"CPU per step on {config} / on tiny, same loop (ratio of medians): {', '.join(ratios)}")
    return columns, cells, notes


def _config_rows(config: str, runs: list[dict[str, Any]]) -> tuple[list[list[str]], dict[str, Any]]:
    cpu, wall = by_round(runs, "cpu_ms"), by_round(runs, "wall_ms")
    cells, over = [], {}
    for variant in dict.fromkeys(r["variant"] for r in runs):
        if not any(variant in r for r in cpu.values()):
            continue
        base = variant != "plain"
        over[variant] = paired_difference(cpu, variant, "plain") if base else None
        sites = next((r.get("pipelined") for r in runs if r["variant"] == variant and r.get("pipelined")), "")
        cells.append(
            [
                config,
                variant,
                f"{statistics.median(r[variant] for r in wall.values() if variant in r):.3f}",
                f"{statistics.median(r[variant] for r in cpu.values() if variant in r):.3f}",
                cell(over[variant], "+.3f"),
                cell(paired_difference(wall, variant, "plain") if base else None, "+.3f"),
                sites or "",
            ]
        )
    return cells, over


def functions(runs: list[dict[str, Any]], top: int, sort: str, only: list[str]) -> list[str]:
    """The cProfile rows of the one profiled run, as a Markdown table (cProfile inflates each call)."""
    rows = next((r["cprofile"] for r in runs if r.get("cprofile")), [])
    rows = [r for r in rows if not only or any(p in r[0] for p in only)]
    rows.sort(key=lambda r: -r[1 if sort == "own" else 2])
    cells = [[name, f"{own:.4f}", f"{cum:.4f}", f"{calls:.1f}"] for name, own, cum, calls in rows[:top]]
    return markdown_table(["function", "own ms/step", "cum ms/step", "calls/step"], cells)
