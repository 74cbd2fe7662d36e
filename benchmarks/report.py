"""Merge the ranks' records, summarize each (config, variant), check the issue's targets, and render
the terminal table and the Markdown report.

Merging takes the slowest rank: a step's time is the maximum over ranks of that step's time (the
ranks meet in collectives every step, so the slowest one sets the pace), and memory and wait figures
are per-rank maxima. A summary pools the merged step times of every round and takes their median;
memory and wait figures are medians over rounds.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.configs import get_config
from benchmarks.spec import ALL_VARIANTS, OURS_TO_TORCHREC
from benchmarks.tiered_report import tiered_lines

__all__ = [
    "Row",
    "Target",
    "check_targets",
    "markdown",
    "merge_ranks",
    "rows_as_dicts",
    "summarize",
    "table",
]

_MIB = 2**20
_PER_RANK = (
    "peak_bytes",
    "baseline_bytes",
    "tensor_peak_bytes",
    "wait_in_forward_ms",
    "assembly_in_wait_ms",
    "labels_ms",
)
TARGET_CONFIG = "input-dist-heavy"


@dataclass(kw_only=True, slots=True)
class Row:
    """One (config, variant) over all rounds."""

    config: str
    variant: str
    status: str
    """`ok`, or `unsupported` with `message`."""
    message: str = ""
    median_step_ms: float | None = None
    """Median over every timed step of every round."""
    round_medians_ms: list[float] | None = None
    spread: float | None = None
    """(slowest - fastest round median) / median: how far apart the rounds were."""
    samples_per_s: float | None = None
    """Global batch (all ranks) over the median step time."""
    vs_plain: float | None = None
    """Median step time over the plain loop's (below 1: faster)."""
    vs_torchrec: float | None = None
    """Median step time over torchrec's same-named pipeline's (ours only)."""
    peak_mib: float | None = None
    """Peak memory growth during warm-up and timed steps (RSS on CPU), MiB."""
    extra_peak_mib: float | None = None
    """`peak_mib` minus the plain loop's."""
    tensor_peak_mib: float | None = None
    """Peak live tensor memory made during the profiled segment, MiB (allocator cache ignored)."""
    extra_tensor_mib: float | None = None
    """`tensor_peak_mib` minus the plain loop's."""
    batch_mib: float | None = None
    """Size of one input batch of one rank, MiB."""
    wait_in_forward_ms: float | None = None
    """Per step, time inside forward spent waiting on input_dist; for the plain loop and the Base
    pipelines the whole inline input_dist."""
    assembly_in_wait_ms: float | None = None
    """Of `wait_in_forward_ms`, torchrec's reordering of the received ids (CPU work, no waiting)."""
    schedule: str | None = None
    """Our SparseDist/Prefetch: the input_dist schedule "auto" kept, per round (e.g. "early x4")."""
    cache_hit_rate: float | None = None
    """Tables on disk: rows found in the cache over rows looked up, timed steps (median of rounds)."""
    store_read_ms: float | None = None
    """Tables on disk: time reading the store per step, slowest rank (median of rounds)."""
    prefetch_ms: float | None = None
    """Tables on disk: time making a batch's rows resident per step, slowest rank, on whichever
    thread ran it (median of rounds)."""
    cpu_ms: float | None = None
    """Process CPU time per timed step (all threads), the busiest rank (median of rounds): steadier
    than wall time on a shared machine, and what a prefetch thread costs beside compute."""


@dataclass(kw_only=True, slots=True)
class Target:
    """One of the issue's targets, as measured."""

    name: str
    measured: float | None
    limit: float
    met: bool | None
    """None when a figure it needs is missing."""


def merge_ranks(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One record per run, from every rank's records (same order on every rank)."""
    merged = []
    for records in zip(*per_rank, strict=True):
        first = records[0]
        keys = {(r["config"], r["variant"], r["round"]) for r in records}
        if len(keys) != 1:
            raise ValueError(f"ranks disagree on the run order: {sorted(keys)}")
        run = {k: first[k] for k in ("config", "variant", "round", "position", "status", "batch_bytes")}
        run["schedule"] = first.get("schedule")  # the same on every rank (they agree on it)
        run["tuner"] = first.get("tuner")  # likewise
        if first["status"] != "ok":
            run["message"] = first.get("message", "")
            merged.append(run)
            continue
        run["step_times_s"] = [max(ts) for ts in zip(*(r["step_times_s"] for r in records), strict=True)]
        keys = ("peak_bytes", "tensor_peak_bytes", "wait_in_forward_ms", "forward_ms", "agreement_ms")
        for key in (*keys, "cpu_ms", "kjt_check_us"):
            if key in first:
                run[key] = max(r[key] for r in records)
        if "cache_hit_rate" in first:  # tables on disk: mean hit rate, slowest rank's I/O
            run["cache_hit_rate"] = statistics.mean(r["cache_hit_rate"] for r in records)
            for key in ("store_read_ms", "prefetch_ms"):
                run[key] = max(r[key] for r in records)
        if "assembly_in_wait_ms" in first:  # from the rank whose wait is reported
            run["assembly_in_wait_ms"] = max(records, key=lambda r: r["wait_in_forward_ms"])[
                "assembly_in_wait_ms"
            ]
        run["ranks"] = [{k: r[k] for k in _PER_RANK if k in r} for r in records]
        merged.append(run)
    return merged


def summarize(runs: list[dict[str, Any]], *, world_size: int) -> list[Row]:
    """One `Row` per (config, variant), in config then `ALL_VARIANTS` order."""
    rows: dict[tuple[str, str], Row] = {}
    for config, variant in _pairs(runs):
        mine = [r for r in runs if r["config"] == config and r["variant"] == variant]
        ok = [r for r in mine if r["status"] == "ok"]
        if not ok:
            rows[config, variant] = Row(
                config=config, variant=variant, status=mine[0]["status"], message=mine[0].get("message", "")
            )
            continue
        steps = [t for r in ok for t in r["step_times_s"]]
        median = statistics.median(steps) * 1e3
        round_medians = [statistics.median(r["step_times_s"]) * 1e3 for r in ok]
        global_batch = get_config(config).batch_size * world_size
        rows[config, variant] = Row(
            config=config,
            variant=variant,
            status="ok",
            median_step_ms=median,
            round_medians_ms=round_medians,
            spread=(max(round_medians) - min(round_medians)) / median,
            samples_per_s=global_batch / median * 1e3,
            peak_mib=statistics.median(r["peak_bytes"] for r in ok) / _MIB,
            batch_mib=ok[0]["batch_bytes"] / _MIB,
            wait_in_forward_ms=_median_of(ok, "wait_in_forward_ms"),
            assembly_in_wait_ms=_median_of(ok, "assembly_in_wait_ms"),
            schedule=_schedules(ok),
            tensor_peak_mib=_mib(_median_of(ok, "tensor_peak_bytes")),
            cache_hit_rate=_median_of(ok, "cache_hit_rate"),
            store_read_ms=_median_of(ok, "store_read_ms"),
            prefetch_ms=_median_of(ok, "prefetch_ms"),
            cpu_ms=_median_of(ok, "cpu_ms"),
        )
    for (config, variant), row in rows.items():
        plain = rows.get((config, "plain"))
        torchrec = rows.get((config, OURS_TO_TORCHREC.get(variant, "")))
        if row.median_step_ms is None:
            continue
        if plain and plain.median_step_ms:
            row.vs_plain = row.median_step_ms / plain.median_step_ms
            row.extra_peak_mib = row.peak_mib - plain.peak_mib
            if row.tensor_peak_mib is not None and plain.tensor_peak_mib is not None:
                row.extra_tensor_mib = row.tensor_peak_mib - plain.tensor_peak_mib
        if torchrec and torchrec.median_step_ms:
            row.vs_torchrec = row.median_step_ms / torchrec.median_step_ms
    return list(rows.values())


def _pairs(runs: list[dict[str, Any]]) -> list[tuple[str, str]]:
    configs = list(dict.fromkeys(r["config"] for r in runs))
    present = {(r["config"], r["variant"]) for r in runs}
    return [(c, v) for c in configs for v in ALL_VARIANTS if (c, v) in present]


def _schedules(runs: list[dict[str, Any]]) -> str | None:
    counts = Counter(r.get("schedule") for r in runs if r.get("schedule"))
    return " ".join(f"{name} x{n}" for name, n in counts.most_common()) or None


def _mib(value: float | None) -> float | None:
    return None if value is None else value / _MIB


def _median_of(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def check_targets(rows: list[Row], config: str = TARGET_CONFIG) -> list[Target]:
    """The issue's targets on `config` (meant for a run over a 1 Gbit link)."""
    by = {r.variant: r for r in rows if r.config == config}
    sd, pf, plain = by.get("ours-sparse-dist"), by.get("ours-prefetch"), by.get("plain")

    def target(name: str, measured: float | None, limit: float) -> Target:
        return Target(
            name=name, measured=measured, limit=limit, met=None if measured is None else measured <= limit
        )

    wait_share = None
    if sd and plain and sd.wait_in_forward_ms is not None and plain.wait_in_forward_ms:
        wait_share = sd.wait_in_forward_ms / plain.wait_in_forward_ms
    prefetch_vs_sd = None
    if pf and sd and pf.median_step_ms and sd.median_step_ms:
        prefetch_vs_sd = pf.median_step_ms / sd.median_step_ms
    extra = extra_tensor = None
    if sd and sd.extra_peak_mib is not None and sd.batch_mib:
        extra = max(sd.extra_peak_mib, 0.0) / sd.batch_mib
    if sd and sd.extra_tensor_mib is not None and sd.batch_mib:
        extra_tensor = max(sd.extra_tensor_mib, 0.0) / sd.batch_mib
    return [
        target("SparseDist step / plain step", sd.vs_plain if sd else None, 0.85),
        target("SparseDist step / torchrec SparseDist step", sd.vs_torchrec if sd else None, 0.9),
        target("Prefetch step / SparseDist step", prefetch_vs_sd, 1.0),
        target("SparseDist input_dist wait in forward / plain input_dist", wait_share, 0.05),
        target("SparseDist extra peak RSS / one input batch", extra, 3.0),
        target("SparseDist extra peak tensor memory / one input batch", extra_tensor, 3.0),
    ]


def wait_note(rows: list[Row], config: str = TARGET_CONFIG) -> str | None:
    """How much of SparseDist's wait in forward is torchrec's KJT assembly (not a target: context)."""
    by = {r.variant: r for r in rows if r.config == config}
    sd, plain = by.get("ours-sparse-dist"), by.get("plain")
    if not (sd and plain and plain.wait_in_forward_ms) or None in (
        sd.wait_in_forward_ms,
        sd.assembly_in_wait_ms,
    ):
        return None
    blocked = sd.wait_in_forward_ms - sd.assembly_in_wait_ms
    return (
        f"SparseDist wait in forward is {sd.wait_in_forward_ms:.2f} ms/step, of which "
        f"{sd.assembly_in_wait_ms:.2f} ms reorders the received ids (dist_init:recat_values, CPU work); "
        f"the rest, {blocked:.2f} ms, is {blocked / plain.wait_in_forward_ms:.3f} of plain's input_dist"
    )


_HEADER = ("config", "variant", "step ms", "spread", "samples/s", "vs plain", "vs torchrec", "RSS MiB",
           "+RSS", "tensor MiB", "+tensor", "input_dist in fwd ms", "of it assembly ms",
           "schedule")  # fmt: skip


def _cells(row: Row) -> list[str]:
    if row.status != "ok":
        return [row.config, row.variant, row.message, *[""] * (len(_HEADER) - 3)]

    def f(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    return [
        row.config,
        row.variant,
        f(row.median_step_ms, ".1f"),
        f(row.spread, ".0%"),
        f(row.samples_per_s, ",.0f"),
        f(row.vs_plain, ".2f"),
        f(row.vs_torchrec, ".2f"),
        f(row.peak_mib, ".1f"),
        f(row.extra_peak_mib, "+.1f"),
        f(row.tensor_peak_mib, ".1f"),
        f(row.extra_tensor_mib, "+.1f"),
        f(row.wait_in_forward_ms, ".2f"),
        f(row.assembly_in_wait_ms, ".2f"),
        row.schedule or "-",
    ]


def table(rows: list[Row], targets: list[Target], *, world_size: int) -> str:
    """The terminal table, then the targets."""
    lines = [list(_HEADER), *(_cells(r) for r in rows if r.status == "ok")]
    widths = [max(len(line[i]) for line in lines) for i in range(len(_HEADER))]

    def render(line: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True))
        )

    out = [render(lines[0]), "  ".join("-" * w for w in widths)]
    for row in rows:
        if row.status == "ok":
            out.append(render(_cells(row)))
        else:
            out.append(f"{row.config.ljust(widths[0])}  {row.variant.ljust(widths[1])}  {row.message}")
    out += ["", f"targets ({TARGET_CONFIG}):", *(_target_line(t) for t in targets)]
    note = wait_note(rows)
    if note:
        out.append(f"  note   {note}")
    tiered = tiered_lines(rows, world_size=world_size)
    return "\n".join([*out, *([""] if tiered else []), *tiered])


def _target_line(t: Target) -> str:
    verdict = "n/a" if t.met is None else ("met" if t.met else "MISSED")
    measured = "-" if t.measured is None else f"{t.measured:.3f}"
    return f"  {verdict:6} {t.name}: {measured} (limit {t.limit})"


def markdown(rows: list[Row], targets: list[Target], meta: dict[str, Any]) -> str:
    """The Markdown report: how it was run, the table, the targets."""
    lines = [
        "# Benchmark results",
        "",
        f"Command: `{meta['command']}`  ",
        f"Link: {meta['link'] or 'loopback (no emulation)'}; {meta['world_size']} ranks; {meta['host']}  ",
        f"Steps {meta['spec']['steps']} timed + {meta['spec']['warmup']} warm-up, "
        f"{meta['spec']['rounds']} rounds; CPUs {meta['cpu_busy_before']:.0%} busy before start; "
        f"{meta['versions']}",
        "",
        "| " + " | ".join(_HEADER) + " |",
        "|" + "|".join("---" if i < 2 else "---:" for i in range(len(_HEADER))) + "|",
        *("| " + " | ".join(_cells(r)) + " |" for r in rows),
        "",
        f"Targets on `{TARGET_CONFIG}`:",
        "",
        *(f"- {_target_line(t).strip()}" for t in targets),
        *([f"- note: {note}"] if (note := wait_note(rows)) else []),
        "",
        *(
            f"- {line.strip()}" if i else line
            for i, line in enumerate(tiered_lines(rows, world_size=meta["world_size"]))
        ),
        "",
    ]
    return "\n".join(lines)


def rows_as_dicts(rows: list[Row], targets: list[Target]) -> dict[str, Any]:
    """JSON-ready summary and targets."""
    return {"summary": [asdict(r) for r in rows], "targets": [asdict(t) for t in targets]}
