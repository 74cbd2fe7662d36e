"""`python -m benchmarks run`: configs x variants on local ranks, paired interleaved rounds.

`run_benchmark` is what every suite that trains calls: it launches the ranks (behind an emulated
link if asked), merges their records and summarizes each (config, variant). Merging takes the slowest
rank: a step's time is the maximum over ranks of that step's time (the ranks meet in collectives
every step, so the slowest sets the pace); memory, CPU and wait figures are per-rank maxima. A
summary row gives the median over rounds of each run's median step, and every ratio paired within
rounds (`benchmarks.report`).
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.configs import RUN_CONFIGS, get_config
from benchmarks.launch import cpu_hog, launch
from benchmarks.link import emulated_link, parse_rate
from benchmarks.measure import commit, cpu_busy, machine, read_cost_line
from benchmarks.report import Paired, by_round, cell, over_rounds, paired, publish
from benchmarks.spec import VARIANTS, RunSpec, reference

__all__ = ["Row", "merge_ranks", "run", "run_benchmark", "summarize"]

_MIB = 2**20
_DICTS = ("watch", "prefetch_watch", "cprofile")
"""The structured fields of a record kept from rank 0."""
_MAX_OVER_RANKS = ("cpu_ms", "peak_bytes", "tensor_peak_bytes", "wait_in_forward_ms", "forward_ms")
_MAX_OVER_RANKS += ("store_read_ms", "prefetch_ms")  # tables on disk


@dataclass(kw_only=True, slots=True)
class Row:
    """One (config, variant) over its rounds: `Paired` figures are per round, the others medians of
    rounds unless said; `_NOTES`, at the end of every report, says what each figure is."""

    config: str
    variant: str
    status: str
    """`ok`, or `unsupported` with `message`."""
    message: str = ""
    step_ms: Paired | None = None
    """Each round's median step time."""
    samples_per_s: float | None = None
    """The global batch (all ranks) over the median step."""
    vs_plain: Paired | None = None
    reference: str | None = None
    """What else it is compared with (`benchmarks.spec.reference`)."""
    vs_reference: Paired | None = None
    share: Paired | None = None
    total_s: Paired | None = None
    total_vs_reference: Paired | None = None
    """The total over the reference's in the same round (with `--warmup 0`: a cold start)."""
    cpu_ms: Paired | None = None
    rss_mib: float | None = None
    tensor_mib: float | None = None
    wait_in_forward_ms: float | None = None
    """Per step, time forward waits on input_dist (the whole inline input_dist for plain and Base)."""
    assembly_in_wait_ms: float | None = None
    """Of it, torchrec's reordering of the received ids (CPU work, not waiting)."""
    input_a2a_kib: float | None = None
    schedule: str | None = None
    """Our SparseDist/Prefetch under the default ("adaptive"): the schedule kept, counted over rounds."""
    cache_hit_rate: float | None = None
    """Tables on disk: rows found in the cache over rows looked up, mean over ranks."""
    store_read_ms: float | None = None
    prefetch_ms: float | None = None
    """Tables on disk: time making a batch's rows resident per step, on whichever thread ran it."""
    prefetch: str | None = None
    """Our Prefetch under its watch (tables on disk): the mode it ran in at the end, counted over rounds."""
    prefetch_watch: str | None = None
    """What the watch did, round by round: when it observed, tried ahead and decided, and the ratios."""


def run_benchmark(
    spec: RunSpec, *, world_size: int, link: str | None, timeout: float, command: str, hog: int | None = None
) -> dict:
    """Run `spec` on `world_size` local ranks, behind an emulated `link` rate if given, beside a busy
    loop on core `hog` if given (`cpu_hog`).

    Returns:
        The JSON-ready result: `meta`, every merged run record (`runs`), the `summary` rows.

    Raises:
        LinkUnavailable: `link` was asked for and cannot be emulated here.
        LaunchError: a rank failed or timed out.
        ValueError: `--device cuda` with fewer GPUs than ranks.
    """
    if link is not None:
        parse_rate(link)  # before anything is created
        if world_size != 2:
            raise ValueError("an emulated link joins exactly 2 ranks: pass --world-size 2")
    if spec.device == "cuda":
        import torch

        if torch.cuda.device_count() < world_size:
            raise ValueError(
                f"--device cuda needs a GPU per rank: {world_size} ranks, "
                f"{torch.cuda.device_count()} GPUs here; pass --world-size"
            )
    started, busy = time.time(), cpu_busy()
    with cpu_hog(hog) as neighbour, emulated_link(link) if link else nullcontext() as emulated:
        per_rank = launch(spec, world_size=world_size, link=emulated, timeout=timeout)
    runs = merge_ranks(per_rank)
    meta = {
        "command": command,
        "machine": machine(),
        "commit": commit(),
        "cpu_busy_before": round(busy, 3),
        "rounds": spec.rounds,
        "steps": spec.steps,
        "warmup": f"{spec.warmup} ({spec.auto_warmup} on a config where a variant measures first)",
        "where": f"{world_size} rank(s) over {link or 'loopback'}",
        "world_size": world_size,
        "link": link,
        "cpu_hog": neighbour,
        "spec": asdict(spec),
        "duration_s": round(time.time() - started, 1),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
    }
    rows = summarize(runs, world_size=world_size)
    return {"meta": meta, "runs": runs, "summary": [asdict(r) for r in rows]}


def merge_ranks(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One record per run from every rank's records (the same order on every rank)."""
    merged = []
    for records in zip(*per_rank, strict=True):
        first = records[0]
        if len({(r["config"], r["variant"], r["round"]) for r in records}) != 1:
            raise ValueError("ranks disagree on the order of the runs")
        one = {k: v for k, v in first.items() if not isinstance(v, (list, dict)) or k in _DICTS}
        if first["status"] == "ok":
            one["step_times_s"] = [max(ts) for ts in zip(*(r["step_times_s"] for r in records), strict=True)]
            one["wall_ms"] = 1e3 * statistics.mean(one["step_times_s"])
            one["total_s"] = sum(one["step_times_s"])
            one.update({k: max(r[k] for r in records) for k in _MAX_OVER_RANKS if k in first})
            if "cache_hit_rate" in first:
                one["cache_hit_rate"] = statistics.mean(r["cache_hit_rate"] for r in records)
            if "rows_read_per_step" in first:  # process CPU per row read or written, every rank's
                rows = sum(r["rows_read_per_step"] + r["rows_written_per_step"] for r in records)
                one["cpu_us_per_row"] = 1e3 * sum(r["cpu_ms"] for r in records) / rows if rows else None
            if "wait_in_forward_ms" in first:  # from the rank whose wait is reported
                slowest = max(records, key=lambda r: r["wait_in_forward_ms"])
                one["assembly_in_wait_ms"] = slowest["assembly_in_wait_ms"]
                one["labels_ms"] = slowest["labels_ms"]
        merged.append(one)
    return merged


def summarize(runs: list[dict[str, Any]], *, world_size: int) -> list[Row]:
    """One `Row` per (config, variant), in the order first run."""
    rows = []
    for config, variant in dict.fromkeys((r["config"], r["variant"]) for r in runs):
        mine = [r for r in runs if r["config"] == config and r["variant"] == variant]
        ok = [r for r in mine if r["status"] == "ok"]
        if not ok:
            rows.append(
                Row(config=config, variant=variant, status=mine[0]["status"], message=mine[0]["message"])
            )
            continue
        steps = by_round([r for r in runs if r["config"] == config], "step_ms")
        totals = by_round([r for r in runs if r["config"] == config], "total_s")
        step = over_rounds([statistics.median(r["step_times_s"]) * 1e3 for r in ok])
        ref = reference(variant)
        schedules = Counter(r["schedule"] for r in ok if r.get("schedule"))
        modes = Counter(("ahead" if r["prefetch_ahead"] else "inline") for r in ok if r.get("prefetch_watch"))
        rows.append(
            Row(
                config=config,
                variant=variant,
                status="ok",
                step_ms=step,
                samples_per_s=get_config(config).batch_size * world_size / step.median * 1e3,
                vs_plain=paired(steps, variant, "plain") if variant != "plain" else None,
                reference=ref,
                vs_reference=paired(steps, variant, ref) if ref else None,
                share=over_rounds([v for r in ok if (v := _share(r)) is not None]),
                total_s=over_rounds([r["total_s"] for r in ok]),
                total_vs_reference=paired(totals, variant, ref) if ref else None,
                cpu_ms=over_rounds([r["cpu_ms"] for r in ok]),
                rss_mib=_median(ok, "peak_bytes", _MIB),
                tensor_mib=_median(ok, "tensor_peak_bytes", _MIB),
                wait_in_forward_ms=_median(ok, "wait_in_forward_ms"),
                assembly_in_wait_ms=_median(ok, "assembly_in_wait_ms"),
                input_a2a_kib=_median(ok, "input_a2a_bytes", 1024),
                schedule=" ".join(f"{s} x{n}" for s, n in schedules.most_common()) or None,
                cache_hit_rate=_median(ok, "cache_hit_rate"),
                store_read_ms=_median(ok, "store_read_ms"),
                prefetch_ms=_median(ok, "prefetch_ms"),
                prefetch=" ".join(f"{m} x{n}" for m, n in modes.most_common()) or None,
                prefetch_watch="; ".join(w for r in ok if (w := _prefetch_watch(r))) or None,
            )
        )
    return rows


def _prefetch_watch(run: dict[str, Any]) -> str | None:
    """One round of Prefetch's watch in words: when it observed, each decision's step, the ratios."""
    watch = run.get("prefetch_watch")
    if not watch:
        return None
    steps = [str(step) for step, _ in watch["decisions"]]
    ratios = ", ".join(f"{r:.2f}" for r in watch["ratios"])
    shares = ", ".join(f"{v:.2f}" for v in watch["shares"])
    seen = f"round {run['round']}: observed from step {watch['ready_at']}"
    seen += f" (shares {shares})" if shares else ""
    if len(steps) == 2:
        return f"{seen}, tried ahead at {steps[0]}, {watch['phase']} at {steps[1]} (ratios {ratios})"
    return f"{seen}, {watch['phase']}" + (f" at {', '.join(steps)}" if steps else "")


def _share(run: dict[str, Any]) -> float | None:
    watch = run.get("watch") or {}
    if watch.get("shares"):
        return statistics.fmean(watch["shares"])
    return watch.get("share")


def _median(runs: list[dict[str, Any]], key: str, scale: float = 1.0) -> float | None:
    values = [r[key] / scale for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


_COLUMNS = [  # (column, field of a summary row, format)
    ("step ms", "step_ms", ".1f"),
    ("samples/s", "samples_per_s", ",.0f"),
    ("vs plain", "vs_plain", ".2f"),
    ("vs reference", "vs_reference", ""),
    ("CPU ms", "cpu_ms", ".1f"),
    ("RSS MiB", "rss_mib", ".1f"),
    ("tensor MiB", "tensor_mib", ".1f"),
    ("input_dist in fwd ms", "wait_in_forward_ms", ".2f"),
    ("of it assembly", "assembly_in_wait_ms", ".2f"),
    ("input a2a KiB", "input_a2a_kib", ",.0f"),
    ("schedule kept", "schedule", ""),
    ("share blocked", "share", ".2f"),
    ("total s", "total_s", ".2f"),
    ("total vs reference", "total_vs_reference", ".3f"),
]
_DISK_COLUMNS = [
    ("hit rate", "cache_hit_rate", ".3f"),
    ("store read ms", "store_read_ms", ".1f"),
    ("resident ms", "prefetch_ms", ".1f"),
    ("prefetch kept", "prefetch", ""),
]


def table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str | None]], list[str]]:
    """The summary's columns, cells and notes (rows as in the JSON: `Paired` figures as dicts)."""
    shown = _COLUMNS + (_DISK_COLUMNS if any(r["cache_hit_rate"] is not None for r in rows) else [])
    cells = []
    for r in (r for r in rows if r["status"] == "ok"):
        v = {k: Paired(**x) if isinstance(x, dict) else x for k, x in r.items()}
        v["vs_reference"] = v["vs_reference"] and f"{v['vs_reference']:.2f} ({r['reference']})"
        cells.append([f"{r['config']} / {r['variant']}", *(cell(v.get(key), spec) for _, key, spec in shown)])
    notes = [f"{r['config']} / {r['variant']}: {r['message']}" for r in rows if r["status"] != "ok"]
    notes += [
        f"{r['config']} / {r['variant']}, its prefetch watch: {w}"
        for r in rows
        if (w := r.get("prefetch_watch"))
    ]
    return ["config / variant", *(c for c, _, _ in shown)], cells, [*notes, *_NOTES]


_NOTES = [
    "vs reference: our class over torchrec's same class; a variant with @SCHEDULE or +FLAG over the same "
    "one without it. CPU ms: process CPU time per step (all threads), the busiest rank.",
    "RSS MiB: peak growth of the resident set; tensor MiB: peak of live tensor bytes, and input_dist in "
    "fwd ms: time forward waits on input_dist, both per step of the profiled segment.",
    "share blocked: under the default schedule, the share of the step the host was blocked on the input "
    "all-to-alls under torchrec's order (the ranks' mean when it moved to early, else rank 0's last 8 "
    "steps). total s: the timed steps' total; total vs reference: over the reference's, paired.",
    "input a2a KiB: what one batch hands to the input (KJT values) all-to-alls on rank 0, its own share "
    "included, counted in the warm-up steps (ours sends int32 ids where a module gets enough ids a "
    "batch; always with +narrow, never with +wide).",
]


def run(
    *,
    configs: list[str],
    variants: list[str],
    world_size: int,
    link: str | None,
    timeout: float,
    json: str | None,
    md: str | None,
    cpu_hog: int | None,
    command: str,
    **fields: Any,
) -> int:
    """The `run` subcommand: train, print the summary, write the JSON and the Markdown. `fields`: the
    `RunSpec`'s other fields (steps, rounds, device, ...), from the flags of the same names."""
    spec = RunSpec(configs=tuple(configs or RUN_CONFIGS), variants=tuple(variants or VARIANTS), **fields)
    on_disk = spec.device == "cpu" and any(get_config(c).cache_fraction is not None for c in spec.configs)
    disk = read_cost_line(spec.store_dir) if on_disk else None  # before the runs, on a quiet machine
    if disk:
        print(f"[bench] {disk}", flush=True)
    result = run_benchmark(
        spec, world_size=world_size, link=link, timeout=timeout, command=command, hog=cpu_hog
    )
    if disk:
        result["meta"]["disk"] = disk
    columns, cells, notes = table(result["summary"])
    if spec.device == "cuda":
        notes.append(
            "On CUDA, RSS MiB is the peak growth of the GPU memory allocated (torch.cuda."
            "max_memory_allocated), not of the resident set."
        )
    notes += [disk] if disk else []
    publish(result, "Benchmark results", columns, cells, notes, json_path=json, md_path=md)
    return 0
