"""Analyse a sweep: paired ratios per point, the bound, the schedule checks; render the table, the
Markdown and the PNG.

Ratios are paired: in each round every variant of a point runs once (order rotated), so a round's
ratio A/B divides the two runs' median step times from the same round, and slow drift of the
machine cancels. A ratio is reported as the median over rounds with the lowest and highest round
(`Paired`). Step times are the slower rank's, as in `benchmarks.report`.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.paired import Paired, paired, round_medians
from benchmarks.spec import FORCED_VARIANTS

__all__ = [
    "Check",
    "PointResult",
    "analyse",
    "checks",
    "markdown",
    "plot",
    "table",
]

TORCHREC = "torchrec-sparse-dist"
SD, PF, BASE, PLAIN = "ours-sparse-dist", "ours-prefetch", "ours-base", "plain"
TOLERANCE = 0.03
"""Ratios within this of 1.0 are "the same" (the tuner's margin): see `Check` and `auto_right`."""
PLOTTED = (PLAIN, BASE, SD, PF, *FORCED_VARIANTS)


@dataclass(kw_only=True, slots=True)
class PointResult:
    """Everything the sweep says about one point."""

    name: str
    link: str | None
    description: str
    median_ms: dict[str, float]
    """Per variant, the median over every timed step of every round."""
    vs_torchrec: dict[str, Paired]
    """Per variant, its paired ratio to torchrec's SparseDist."""
    sd_vs_torchrec: Paired | None
    pf_vs_sd: Paired | None
    base_vs_plain: Paired | None
    compute_ms: float | None
    comm_ms: float | None
    to_bound: dict[str, float] = field(default_factory=dict)
    """Per variant, median step / max(compute alone, communication alone)."""
    auto_choices: dict[str, list[str]] = field(default_factory=dict)
    """Per auto variant, the schedule each round's run ended on."""
    fastest_forced: str | None = None
    auto_right: bool | None = None
    """Our SparseDist's "auto" ended, in most rounds, on a schedule whose forced median is within
    `TOLERANCE` of the fastest forced one."""
    tuning_cost: float | None = None
    """Median over auto runs of the time tuning lost against the kept schedule, as a fraction of a
    1,000-step run at the kept schedule's forced step time."""

    @property
    def bound_ms(self) -> float | None:
        return None if self.compute_ms is None or self.comm_ms is None else max(self.compute_ms, self.comm_ms)

    @property
    def network_bound(self) -> bool | None:
        return None if self.bound_ms is None else self.comm_ms > self.compute_ms


@dataclass(kw_only=True, slots=True)
class Check:
    name: str
    point: str
    measured: str
    met: bool | None


def analyse(runs: list[dict[str, Any]], *, name: str, link: str | None, description: str) -> PointResult:
    """One point's figures from its merged run records (`benchmarks.report.merge_ranks`)."""
    rounds = round_medians(runs)
    pooled: dict[str, list[float]] = {}
    for r in runs:
        if r["status"] == "ok":
            pooled.setdefault(r["variant"], []).extend(r["step_times_s"])
    median_ms = {v: statistics.median(t) * 1e3 for v, t in pooled.items()}
    result = PointResult(
        name=name,
        link=link,
        description=description,
        median_ms=median_ms,
        vs_torchrec={v: p for v in median_ms if (p := paired(rounds, v, TORCHREC))},
        sd_vs_torchrec=paired(rounds, SD, TORCHREC),
        pf_vs_sd=paired(rounds, PF, SD),
        base_vs_plain=paired(rounds, BASE, PLAIN),
        compute_ms=median_ms.get("compute-alone"),
        comm_ms=median_ms.get("comm-alone"),
    )
    if result.bound_ms:
        result.to_bound = {
            v: m / result.bound_ms for v, m in median_ms.items() if v in PLOTTED or v == TORCHREC
        }
    for variant in (SD, PF):
        result.auto_choices[variant] = [
            r["schedule"] for r in runs if r["variant"] == variant and r.get("schedule")
        ]
    _judge_auto(result, [r for r in runs if r["variant"] == SD and r.get("tuner")])
    return result


def _judge_auto(result: PointResult, auto_runs: list[dict[str, Any]]) -> None:
    forced = {v.split("@")[1]: m for v, m in result.median_ms.items() if v in FORCED_VARIANTS}
    if not forced:
        return
    result.fastest_forced = min(forced, key=forced.get)
    best = forced[result.fastest_forced]
    choices = result.auto_choices.get(SD, [])
    if choices:
        good = sum(forced.get(c, float("inf")) <= best * (1 + TOLERANCE) for c in choices)
        result.auto_right = good * 2 > len(choices)
    costs = []
    for run in auto_runs:
        kept = forced.get(run["schedule"])
        steps = run["tuner"].get("tuning_steps_by_schedule") or {}
        if kept and all(s in forced for s in steps):
            costs.append(sum(n * max(0.0, forced[s] - kept) for s, n in steps.items()) / (1000 * kept))
    result.tuning_cost = statistics.median(costs) if costs else None


def _le_one(p: Paired | None) -> bool | None:
    """Median <= 1, and the rounds' interval crosses 1.0 only where the two are within 3 %."""
    if p is None:
        return None
    return p.median <= 1.0 and (p.high <= 1.0 or p.median >= 1 - TOLERANCE)


def _fmt(p: Paired | None) -> str:
    return "-" if p is None else f"{p.median:.2f} [{p.low:.2f}, {p.high:.2f}]"


def checks(points: list[PointResult]) -> list[Check]:
    """The issue's criteria, per point and over the sweep."""
    out = []
    for p in points:
        out += [
            Check(name="our SparseDist <= torchrec's", point=p.name, measured=_fmt(p.sd_vs_torchrec),
                  met=_le_one(p.sd_vs_torchrec)),
            Check(name="our Prefetch <= our SparseDist", point=p.name, measured=_fmt(p.pf_vs_sd),
                  met=_le_one(p.pf_vs_sd)),
            Check(name="our Base <= plain", point=p.name, measured=_fmt(p.base_vs_plain),
                  met=_le_one(p.base_vs_plain)),
        ]  # fmt: skip
        if p.network_bound and p.sd_vs_torchrec:
            to_bound = p.to_bound.get(SD)
            met = p.sd_vs_torchrec.median <= 0.8 and to_bound is not None and to_bound <= 1.2
            measured = f"{p.sd_vs_torchrec.median:.2f}x torchrec, {to_bound or float('nan'):.2f}x bound"
            out.append(Check(name="network-bound: <= 0.8x torchrec, <= 1.2x bound", point=p.name,
                             measured=measured, met=met))  # fmt: skip
    judged = [p for p in points if p.auto_right is not None]
    if judged:
        right = sum(p.auto_right for p in judged)
        out.append(Check(name="auto on the faster forced schedule on >= 90 % of points", point="all",
                         measured=f"{right}/{len(judged)}", met=right >= 0.9 * len(judged)))  # fmt: skip
    costs = [p.tuning_cost for p in points if p.tuning_cost is not None]
    if costs:
        out.append(Check(name="tuning < 2 % of a 1,000-step run", point="all",
                         measured=f"max {max(costs):.2%}", met=max(costs) < 0.02))  # fmt: skip
    return out


_HEADER = ("point", "link", "bound by", "compute ms", "comm ms", "torchrec SD ms", "ours SD / torchrec",
           "ours PF / ours SD", "ours Base / plain", "SD / bound", "auto kept", "fastest forced",
           "tuning cost")  # fmt: skip


def _cells(p: PointResult) -> list[str]:
    def f(v: float | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    kind = "-" if p.network_bound is None else ("network" if p.network_bound else "compute")
    kept = Counter(p.auto_choices.get(SD, []))
    mark = "" if p.auto_right is None else (" ok" if p.auto_right else " WRONG")
    return [
        p.name.removeprefix("sweep-"),
        p.link or "loopback",
        kind,
        f(p.compute_ms, ".1f"),
        f(p.comm_ms, ".1f"),
        f(p.median_ms.get(TORCHREC), ".1f"),
        _fmt(p.sd_vs_torchrec),
        _fmt(p.pf_vs_sd),
        _fmt(p.base_vs_plain),
        f(p.to_bound.get(SD), ".2f"),
        " ".join(f"{s} x{n}" for s, n in kept.most_common()) + mark,
        p.fastest_forced or "-",
        f(p.tuning_cost, ".2%"),
    ]


def table(points: list[PointResult]) -> str:
    """The terminal table."""
    lines = [list(_HEADER), *(_cells(p) for p in points)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(_HEADER))]
    render = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in lines]
    return "\n".join([render[0], "  ".join("-" * w for w in widths), *render[1:]])


def _forced_table(points: list[PointResult]) -> list[str]:
    names = [v.split("@")[1] for v in FORCED_VARIANTS]
    lines = ["| point | " + " | ".join(f"{n} ms" for n in names) + " | auto (SD) | auto (PF) |",
             "|---|" + "---:|" * len(names) + "---|---|"]  # fmt: skip
    for p in points:
        cells = [f"{p.median_ms[v]:.1f}" if v in p.median_ms else "-" for v in FORCED_VARIANTS]
        autos = [", ".join(p.auto_choices.get(v, [])) or "-" for v in (SD, PF)]
        lines.append(f"| {p.name.removeprefix('sweep-')} | " + " | ".join(cells + autos) + " |")
    return lines


def markdown(points: list[PointResult], meta: dict[str, Any]) -> str:
    """The Markdown report: conditions, the table, forced schedules, the checks."""
    verdict = {True: "met", False: "**MISSED**", None: "n/a"}
    lines = [
        "# Sweep results",
        "",
        f"Command: `{meta['command']}`  ",
        f"{meta['host']}; {meta['versions']}; started {meta['started']}, {meta['duration_s']:.0f} s  ",
        f"Per point: {meta['rounds']} rounds (order rotated), {meta['steps']} timed steps per run after "
        f"{meta['warmup']} warm-up ({meta['auto_warmup']} for the auto-tuning variants)  ",
        f"CPUs busy before each link's runs: {meta['cpu_busy']}"
        + (" **(other work was running: figures are noisy)**" if meta.get("busy_warning") else ""),
        "",
        "Ratios: paired median over rounds [lowest, highest round]. `bound by`: whether communication "
        "alone or compute alone is the larger; `SD / bound`: our SparseDist's step over max(compute "
        "alone, comm alone). `auto kept`: the schedule our SparseDist's auto ended on, per round (ok: "
        f"within {TOLERANCE:.0%} of the fastest forced schedule). `tuning cost`: time the tuner lost "
        "against the kept schedule, as a share of a 1,000-step run.",
        "",
        "| " + " | ".join(_HEADER) + " |",
        "|" + "|".join("---" if i < 3 else "---:" for i in range(len(_HEADER))) + "|",
        *("| " + " | ".join(_cells(p)) + " |" for p in points),
        "",
        "Forced schedules of our SparseDist (median step ms), and what auto kept per round:",
        "",
        *_forced_table(points),
        "",
        "Checks:",
        "",
        *(f"- {verdict[c.met]}: {c.name} ({c.point}): {c.measured}" for c in checks(points)),
        "",
        "![ratio to torchrec's SparseDist per point](sweep.png)",
        "",
    ]
    return "\n".join(lines)


def plot(points: list[PointResult], path: str, title: str) -> None:
    """Each variant's ratio to torchrec's SparseDist per point, with the rounds' spread; the bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(points) + 3), 5.5))
    xs = range(len(points))
    width = 0.8 / len(PLOTTED)
    for i, variant in enumerate(PLOTTED):
        forced = variant in FORCED_VARIANTS
        got = [
            (x, p.vs_torchrec[variant]) for x, p in zip(xs, points, strict=True) if variant in p.vs_torchrec
        ]
        if not got:
            continue
        x = [g[0] - 0.4 + (i + 0.5) * width for g in got]
        y = [g[1].median for g in got]
        err = [[g[1].median - g[1].low for g in got], [g[1].high - g[1].median for g in got]]
        ax.errorbar(x, y, yerr=err, fmt="o" if not forced else ".", ms=6 if not forced else 4,
                    alpha=0.5 if forced else 1.0, capsize=2, label=variant)  # fmt: skip
    bound = [(x, p.bound_ms / p.median_ms[TORCHREC]) for x, p in zip(xs, points, strict=True)
             if p.bound_ms and p.median_ms.get(TORCHREC)]  # fmt: skip
    if bound:
        ax.scatter([b[0] for b in bound], [b[1] for b in bound], marker="_", s=600, c="k", label="bound")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(list(xs), [f"{p.name.removeprefix('sweep-')}" for p in points], rotation=40, ha="right")
    ax.set_ylabel("step time / torchrec SparseDist (paired median, bars: rounds' range)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def as_dict(p: PointResult) -> dict[str, Any]:
    return {**asdict(p), "bound_ms": p.bound_ms, "network_bound": p.network_bound}
