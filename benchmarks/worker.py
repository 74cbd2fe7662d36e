"""One rank of a benchmark: every config, round and variant of a `RunSpec`, in the order all ranks agree on.

Started by `benchmarks.launch` as `python -m benchmarks.worker SPEC OUT` with the torchrun environment
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; GLOO_SOCKET_IFNAME under link emulation); writes this
rank's records to OUT as JSON. One run of one variant: build the model (the same seed for every
variant; its seconds, the tables' initialisation included, are the record's `build_s`), reset the
peak-memory tracker, the untimed warm-up steps, the timed steps (wall time of each, process CPU time
of all), then a separate profiled segment (so the profiler's cost never reaches the step times), then
the batches still in flight are drained. Configs with tables on disk create their stores afresh for
every run, dropped from the page cache before the warm-up, and record the caches' counters over the
timed steps (`tiered_stats()`).
"""

from __future__ import annotations

import copy
import cProfile
import dataclasses
import gc
import json
import logging
import os
import pstats
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from benchmarks import bound
from benchmarks.configs import BenchConfig, get_config
from benchmarks.measure import InputBytes, peak, reset_peak, summarize_profile, tensor_peak_bytes
from benchmarks.models import batch_nbytes, build_model, make_batches
from benchmarks.spec import BOUND, CPU_UNSUPPORTED, RunSpec, round_order
from benchmarks.variants import Runner, labelled_input_dist, make_runner
from tiered import TieredShardedEmbeddingBagCollection

__all__ = ["run_rank"]

_TAIL = 2  # batches beyond the measured ones, so the profiled steps still have i+1 and i+2 in flight
_PRIMERS = ("plain", "ours-sparse-dist", "torchrec-sparse-dist")
_CACHE_KEYS = ("hits", "misses", "read_seconds", "prefetch_seconds", "rows_read", "rows_written")


def run_rank(spec: RunSpec, rank: int) -> list[dict[str, Any]]:
    """Every (config, round, variant) run on this rank; the process group must be initialized."""
    device = torch.device(spec.device, rank if spec.device == "cuda" else None)
    records = []
    for name in spec.configs:
        config = get_config(name)
        count = spec.warmup_of(name) + spec.steps + spec.profile_steps + _TAIL
        batches = make_batches(config, count=count, rank=rank, seed=spec.seed)
        # One-time costs of the process (thread pools, allocator arenas, first fx trace) land here.
        for variant in _PRIMERS:
            runner = make_runner(variant, *_build(spec, config, variant, device), device, captured=None)
            _drain(runner, iter(batches[:4]))
            dist.barrier()
        captured = None
        if set(spec.variants) & set(BOUND):
            model, optimizer = _build(spec, config, "plain", device)
            captured = bound.capture(model, optimizer, batches[: spec.warmup_of(name) + spec.steps], device)
            del model, optimizer
        for round_index in range(spec.rounds):
            for position, variant in enumerate(round_order(spec.variants, round_index)):
                record = dict(config=name, variant=variant, round=round_index, position=position)
                record.update(batch_bytes=batch_nbytes(batches[0]), status="ok")
                record.update(_run_one(spec, config, variant, batches, device, captured, round_index, rank))
                records.append(record)
                if rank == 0:
                    brief = record.get("message") or (
                        f"{1e3 * statistics.median(record['step_times_s']):.1f} ms, built in "
                        f"{record['build_s']:.1f} s"
                    )
                    print(f"[bench] {name} round {round_index} {variant}: {brief}", flush=True)
    return records


def _build(spec: RunSpec, config: BenchConfig, variant: str, device: torch.device) -> tuple[Any, Any]:
    gc.collect()  # the models of the runs before freed first: their tables may be tens of GB (UVM rows)
    if variant == "compute-alone" and config.cache_fraction is not None:
        config = dataclasses.replace(config, cache_fraction=1.0)  # every row cached: no step reads the disk
    store = Path(spec.store_dir) / config.name
    store.mkdir(parents=True, exist_ok=True)
    built = build_model(config, device=device, seed=spec.seed, store_dir=str(store))
    return built.model, built.optimizer


def _run_one(
    spec: RunSpec,
    config: BenchConfig,
    variant: str,
    batches: list,
    device: torch.device,
    captured: bound.Captured | None,
    round_index: int,
    rank: int,
) -> dict[str, Any]:
    started = time.perf_counter()
    model, optimizer = _build(spec, config, variant, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the tables' initialisation is queued on the device
    build_s = time.perf_counter() - started
    tiered = [m for m in model.modules() if isinstance(m, TieredShardedEmbeddingBagCollection)]
    for cache in (c for m in tiered for k in m.tiered_kernels() for c in k.caches):
        cache.store.drop_page_cache()  # cold: the run's first read of every row goes to the disk
    if "+free-features" in variant:
        # the flag frees the features of the batches it trains (on CPU, these very objects): keep the
        # shared ones for the variants after it (the copy is in the baseline, not the peak)
        batches = copy.deepcopy(batches)
    dist.barrier()
    baseline = reset_peak(device)
    it = iter(batches)
    try:
        runner = make_runner(variant, model, optimizer, device, captured=captured)
        with InputBytes() as sent:  # counted in the warm-up only: the timed steps run unwrapped
            for _ in range(spec.warmup_of(config.name)):
                runner.step(it)
                sent.step()
        record = _timed(runner, it, spec, variant, rank, tiered)
        record["input_a2a_bytes"] = sent.per_batch()
    except Exception as e:
        if variant not in CPU_UNSUPPORTED or device.type != "cpu":
            raise
        # torchrec 1.8's Prefetch pipeline prefetches only on CUDA and its forward then refuses the
        # batch; its Fused and SemiSync record CPU tensors on a stream. Every rank fails at the same
        # point. Free its objects while the process group lives (else the process can abort at exit),
        # and let gloo's barrier wait for every collective it launched.
        message = f"does not run on CPU ({type(e).__name__}: {e})"
        del e
        gc.collect()
        dist.barrier()
        return {"status": "unsupported", "message": message}
    record.update(peak_bytes=peak(device) - baseline, baseline_bytes=baseline, build_s=build_s)
    pipe = runner.pipe
    record["schedule"] = getattr(pipe, "input_dist_schedule", None)
    if hasattr(pipe, "prefetch_ahead"):  # Prefetch: the mode its watch kept, and why
        record.update(prefetch_ahead=pipe.prefetch_ahead, prefetch_reason=pipe.prefetch_reason)
        watch = pipe.prefetch_watch
        if watch is not None:  # under "auto" on CPU: what it saw, and when it decided
            record["prefetch_watch"] = _watch(watch, "ready_at")
    report = getattr(pipe, "rewrite_report", None)
    if report is not None:  # a pipeline that fell back to forward costs less: say it beside its figures
        sites = report.sites
        record["pipelined"] = f"{sum(s.reason is None for s in sites)}/{len(sites)} call sites"
    watch = getattr(pipe, "tuner", None)
    if watch is not None:  # the default's schedule watch: what it saw, and when it decided
        record["watch"] = _watch(watch, "parts", "choice", "reason", "medians_ms", "tuning_steps_by_schedule")
    if spec.profile_steps and runner.profile:
        trace = None
        if spec.trace_dir:
            trace = Path(spec.trace_dir) / f"{config.name}_{variant}_r{round_index}_rank{rank}.json"
        record.update(_profiled(runner, model, it, spec.profile_steps, device, trace))
    _drain(runner, it)
    return record


def _watch(watch: Any, *more: str) -> dict[str, Any]:
    """What a watch saw and decided (its phase, shares, ratios and decisions), and its fields `more`."""
    names = ("share", "shares", "ratios", "decisions", *more)
    return {"phase": watch.phase.value, **{n: getattr(watch, n) for n in names}}


def _timed(runner: Runner, it: Iterator[Any], spec: RunSpec, variant: str, rank: int, tiered: list) -> dict:
    """The timed steps: each step's wall time, the process CPU time, the caches' counters, a cProfile."""
    before = _cache_counters(tiered)
    profiler = cProfile.Profile() if spec.cprofile == variant and rank == 0 else None
    times = []
    cpu = time.process_time()
    with profiler or nullcontext():
        for _ in range(spec.steps):
            start = time.perf_counter()
            runner.step(it)
            times.append(time.perf_counter() - start)
    record: dict[str, Any] = {"step_times_s": times, "cpu_ms": 1e3 * (time.process_time() - cpu) / spec.steps}
    if tiered:
        d = {k: v - before[k] for k, v in _cache_counters(tiered).items()}
        record.update(
            cache_hit_rate=d["hits"] / max(d["hits"] + d["misses"], 1),
            store_read_ms=1e3 * d["read_seconds"] / spec.steps,
            prefetch_ms=1e3 * d["prefetch_seconds"] / spec.steps,
            rows_read_per_step=d["rows_read"] / spec.steps,  # CPU per row: cpu_ms over these
            rows_written_per_step=d["rows_written"] / spec.steps,
        )
    if profiler is not None:
        record["cprofile"] = _functions(profiler, spec.steps)
    return record


def _cache_counters(tiered: list) -> dict[str, float]:
    stats = [s for m in tiered for s in m.tiered_stats().values()]
    return {k: sum(s[k] for s in stats) for k in _CACHE_KEYS}


def _functions(
    profiler: cProfile.Profile, steps: int, keep: int = 200
) -> list[tuple[str, float, float, float]]:
    """cProfile's rows: (function, own ms/step, cumulative ms/step, calls/step), the `keep` largest by
    each of the two times."""
    root = str(Path(__file__).resolve().parent.parent) + os.sep
    rows = []
    for (file, line, name), (_, calls, own, cum, _) in pstats.Stats(profiler).stats.items():  # type: ignore[attr-defined]
        where = file.split("site-packages/", 1)[-1].removeprefix(root)
        rows.append((f"{where}:{line}({name})", own / steps * 1e3, cum / steps * 1e3, calls / steps))
    chosen = {r[0]: r for key in (1, 2) for r in sorted(rows, key=lambda r: -r[key])[:keep]}
    return sorted(chosen.values(), key=lambda r: -r[1])


def _profiled(
    runner: Runner, model: Any, it: Iterator[Any], steps: int, device: torch.device, trace: Path | None
) -> dict[str, Any]:
    """`steps` steps under the profiler: forward's input_dist wait, the labels, the tensor peak."""
    inline = labelled_input_dist(model) if runner.inline_input_dist else nullcontext()
    with inline, profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(steps):
            runner.step(it)
    summary = summarize_profile(
        prof.events(), forward_label=runner.forward_label, wait_label=runner.wait_label, steps=steps
    )
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
    return {**dataclasses.asdict(summary), "tensor_peak_bytes": tensor_peak_bytes(prof, device)}


def _drain(runner: Runner, it: Iterator[Any]) -> None:
    """Train what is left, in flight or not, so that no collective is left pending on any rank."""
    try:
        while True:
            runner.step(it)
    except StopIteration:
        pass


def main(argv: list[str]) -> int:
    spec_path, out_path = argv
    spec = RunSpec.from_json(Path(spec_path).read_text())
    warnings.filterwarnings("ignore")  # torchrec's planner and DMP warn on every build
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    logging.getLogger("torch").setLevel(logging.ERROR)
    torch.set_num_threads(1)  # ranks share the cores: one intra-op thread each keeps them from thrashing
    rank = int(os.environ["RANK"])
    if spec.device == "cuda":
        torch.cuda.set_device(rank)  # run_rank's GPU: NCCL's and every kernel's current device
    dist.init_process_group("nccl" if spec.device == "cuda" else "gloo")
    try:
        Path(out_path).write_text(json.dumps(run_rank(spec, rank)))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
