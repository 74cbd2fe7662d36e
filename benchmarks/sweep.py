"""`python -m benchmarks sweep`: 14 points from network-bound (100 Mbit) to compute-bound (loopback).

Per point (`benchmarks.configs.SWEEP_LINKS`), in rotated rounds on 2 ranks: the plain loop, our Base,
SparseDist (its default, "adaptive", which starts in torchrec's order; and each forced schedule) and
Prefetch, torchrec's SparseDist, and the bound's halves (compute alone, communication alone:
`benchmarks.bound`). Points are grouped by link so that each link is set up once. Figures per point:
step times (median over rounds), paired ratios, our SparseDist over max(compute alone, communication
alone), the schedule the default kept in each round, the fastest forced schedule, and what the
default's try cost: the time its verified steps lost against the kept schedule, as a share of a
1,000-step run. Writes the JSON, the Markdown and a PNG of the ratios to torchrec.
"""

from __future__ import annotations

import os
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.configs import SWEEP_LINKS, sweep_points
from benchmarks.report import Paired, by_round, cell, markdown_table, paired, publish, pyplot, save_figure
from benchmarks.run import run_benchmark
from benchmarks.spec import SCHEDULES, RunSpec

__all__ = ["VARIANTS", "analyse", "sweep"]

SD, PF, TR = "ours-sparse-dist", "ours-prefetch", "torchrec-sparse-dist"
FORCED = tuple(f"{SD}@{s}" for s in SCHEDULES)
VARIANTS = ("plain", "ours-base", SD, PF, TR, *FORCED, "compute-alone", "comm-alone")
TOLERANCE = 0.03
"""A schedule within this of the fastest forced one is as good."""


def sweep(
    *,
    points: list[str],
    timeout: float,
    json: str | None,
    md: str | None,
    png: str | None,
    command: str,
    **fields: Any,
) -> int:
    """The `sweep` subcommand: run the points, print the table, write the JSON, Markdown and PNG.
    `fields`: the `RunSpec`'s steps, warm-ups, rounds and seed."""
    names = sweep_points(points)
    runs, meta = [], {}
    for link in dict.fromkeys(SWEEP_LINKS[n] for n in names):
        group = tuple(n for n in names if SWEEP_LINKS[n] == link)
        print(f"[sweep] {link or 'loopback'}: {', '.join(group)}", flush=True)
        spec = RunSpec(configs=group, variants=VARIANTS, profile_steps=0, **fields)
        result = run_benchmark(spec, world_size=2, link=link, timeout=timeout, command=command)
        runs += result["runs"]
        meta = {**result["meta"], "where": "2 ranks; each point's link in the table"}
    results = [analyse([r for r in runs if r["config"] == n], name=n) for n in names]
    more = forced_table(results)
    if png:
        plot(results, png, f"{command}  ({meta['started']})")
        where = os.path.relpath(png, Path(md).parent) if md else Path(png).name  # from the Markdown's folder
        more += [f"![each variant's step over torchrec's SparseDist, per point]({where})", ""]
    result = {"meta": meta, "runs": runs, "points": results}
    publish(result, "Sweep results", *table(results), _NOTES, json_path=json, md_path=md, more=more)
    return 0


_NOTES = [
    "bound by: the larger of communication alone and compute alone. SD / bound: our SparseDist's step "
    "over max(compute alone, communication alone).",
    f"default kept: the schedule our SparseDist ended on under its default, per round (ok: within "
    f"{TOLERANCE:.0%} of the fastest forced schedule). try cost: time the default's verified steps lost "
    "against the kept schedule, as a share of a 1,000-step run.",
]


def analyse(runs: list[dict[str, Any]], *, name: str) -> dict[str, Any]:
    """One point's figures from its merged run records."""
    steps = by_round(runs, "step_ms")
    median = {
        v: statistics.median(r[v] for r in steps.values() if v in r)
        for v in dict.fromkeys(v for r in steps.values() for v in r)
    }
    compute, comm = median.get("compute-alone"), median.get("comm-alone")
    bound = max(compute, comm) if compute and comm else None
    kept = [r["schedule"] for r in runs if r["variant"] == SD and r.get("schedule")]
    forced = {s: m for v, m in median.items() if v in FORCED and (s := v.split("@")[1]) != "adaptive"}
    fastest = min(forced, key=forced.__getitem__) if forced else None
    good = [forced.get(k, float("inf")) <= forced[fastest] * (1 + TOLERANCE) for k in kept] if fastest else []
    right = 2 * sum(good) > len(good) if good else None
    costs = []
    for r in (r for r in runs if r["variant"] == SD and r.get("watch")):
        ran, chosen = r["watch"]["tuning_steps_by_schedule"], forced.get(r.get("schedule") or "")
        if chosen and ran and all(s in forced for s in ran):
            costs.append(sum(n * max(0.0, forced[s] - chosen) for s, n in ran.items()) / (1000 * chosen))
    return {
        "name": name,
        "link": SWEEP_LINKS[name],
        "median_ms": median,
        "compute_ms": compute,
        "comm_ms": comm,
        "vs_torchrec": {v: p for v in median if (p := paired(steps, v, TR))},
        "sd_vs_torchrec": paired(steps, SD, TR),
        "pf_vs_sd": paired(steps, PF, SD),
        "base_vs_plain": paired(steps, "ours-base", "plain"),
        "sd_to_bound": median[SD] / bound if bound and SD in median else None,
        "default_kept": kept,
        "fastest_forced": fastest,
        "default_right": right,
        "try_cost": statistics.median(costs) if costs else None,
    }


def table(points: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The main table: per point, what bounds it, the paired ratios, the bound, the default's choice."""
    columns = (
        "point|link|bound by|compute ms|comm ms|torchrec SD ms|ours SD / torchrec|ours PF / ours SD|"
        "ours Base / plain|SD / bound|default kept|fastest forced|try cost"
    ).split("|")
    cells = []
    for p in points:
        by = "-" if p["compute_ms"] is None else ("network" if p["comm_ms"] > p["compute_ms"] else "compute")
        kept = " ".join(f"{s} x{n}" for s, n in Counter(p["default_kept"]).most_common())
        mark = "" if p["default_right"] is None else (" ok" if p["default_right"] else " not the fastest")
        ratios = ("sd_vs_torchrec", "pf_vs_sd", "base_vs_plain", "sd_to_bound")
        ms = (p["compute_ms"], p["comm_ms"], p["median_ms"].get(TR))
        cells.append(
            [
                p["name"].removeprefix("sweep-"),
                p["link"] or "loopback",
                by,
                *(cell(v, ".1f") for v in ms),
                *(cell(p[k], ".2f") for k in ratios),
                kept + mark,
                p["fastest_forced"] or "-",
                cell(p["try_cost"], ".2%"),
            ]
        )
    return columns, cells


def forced_table(points: list[dict[str, Any]]) -> list[str]:
    """Markdown: our SparseDist's median step per forced schedule and under its default, and what the
    default kept per round."""
    columns = ["point", *(f"{s} ms" for s in SCHEDULES), "default ms", "default kept"]
    shown = (*FORCED, SD)
    cells = [
        [
            p["name"].removeprefix("sweep-"),
            *(cell(p["median_ms"].get(v), ".1f") for v in shown),
            ", ".join(p["default_kept"]) or "-",
        ]
        for p in points
    ]
    intro = "Our SparseDist with each schedule forced and under its default (median step ms); the default's"
    return [f"{intro} choice:", "", *markdown_table(columns, cells), ""]


def plot(points: list[dict[str, Any]], path: str, title: str) -> None:
    """Each variant's paired ratio to torchrec's SparseDist per point, bars the rounds' range; the bound."""
    shown = ("plain", "ours-base", SD, PF, *FORCED)
    fig, ax = pyplot().subplots(figsize=(max(8, 0.9 * len(points) + 3), 5.5))
    width = 0.8 / len(shown)
    for i, variant in enumerate(shown):
        got: list[tuple[int, Paired]] = [
            (x, p["vs_torchrec"][variant]) for x, p in enumerate(points) if variant in p["vs_torchrec"]
        ]
        if got:
            xs, ys = [x - 0.4 + (i + 0.5) * width for x, _ in got], [g.median for _, g in got]
            yerr = [[g.median - g.low for _, g in got], [g.high - g.median for _, g in got]]
            mark = {"fmt": ".", "alpha": 0.5} if variant in FORCED else {"fmt": "o", "alpha": 1.0}
            ax.errorbar(xs, ys, yerr=yerr, capsize=2, label=variant, **mark)
    bound = [
        (x, p["sd_to_bound"] and p["median_ms"][SD] / p["sd_to_bound"] / p["median_ms"][TR])
        for x, p in enumerate(points)
        if p["sd_to_bound"] and TR in p["median_ms"]
    ]
    if bound:
        ax.scatter([b[0] for b in bound], [b[1] for b in bound], marker="_", s=600, c="k", label="bound")
    ax.axhline(1.0, color="grey", lw=0.8)
    names = [p["name"].removeprefix("sweep-") for p in points]
    ax.set_xticks(range(len(points)), names, rotation=40, ha="right")
    ax.set_ylabel("step / torchrec SparseDist (paired median, bars: rounds' range)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    save_figure(fig, path)
