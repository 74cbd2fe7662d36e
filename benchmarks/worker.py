"""One rank of a benchmark: every config, round and variant, in the order both ranks agree on.

Started by `benchmarks.launch` as `python -m benchmarks.worker SPEC OUT` with the usual torchrun
environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; GLOO_SOCKET_IFNAME under link emulation).
It writes this rank's records to OUT as JSON; `benchmarks.report` merges the ranks.

One run of one variant: build the model (same seed for every variant), reset the peak-memory
tracker, `warmup` untimed steps, `steps` steps timed one by one with `perf_counter`, then a separate
profiled segment of `profile_steps` steps (so profiler overhead never reaches the step times), then
drain the batches still in flight. Every variant trains the same pre-generated batches.

Configs with tables on disk (`cache_fraction`) create their stores afresh for every run in a folder
of the config's name in `$BENCH_STORE_DIR` (default: a folder in the temp directory), drop them from
the page cache before the warm-up, and record the cache's hit rate and the store's read time over
the timed steps.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
import logging
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile

from benchmarks import bound, disk_bound
from benchmarks.configs import BenchConfig, get_config
from benchmarks.measure import AgreementClock, peak, reset_peak, summarize_profile, tensor_peak_bytes
from benchmarks.model import batch_nbytes, build_model, make_batches
from benchmarks.spec import CAPTURING_VARIANTS, CPU_UNSUPPORTED, RunSpec, round_order
from benchmarks.variants import Runner, make_runner, timed_input_dist

__all__ = ["run_rank"]

# Batches beyond the measured ones, so that the profiled steps still have i+1 and i+2 in flight.
_TAIL = 2
_PRIMERS = ("plain", "ours-sparse-dist", "torchrec-sparse-dist")


def run_rank(spec: RunSpec, rank: int) -> list[dict[str, Any]]:
    """Every (config, round, variant) run on this rank; the process group must be initialized."""
    device = torch.device(spec.device, rank if spec.device == "cuda" else None)
    records = []
    for name in spec.configs:
        config = get_config(name)
        count = max(spec.warmup, spec.auto_warmup) + spec.steps + spec.profile_steps + _TAIL
        batches = make_batches(config, count=count, rank=rank, seed=spec.seed)
        _prime(config, batches, device, spec.seed)
        captured = None
        if set(spec.variants) & set(CAPTURING_VARIANTS):
            built = build_model(config, device=device, seed=spec.seed, store_dir=_store_dir(config.name))
            timed = batches[: spec.warmup + spec.steps]
            captured = bound.capture(built.model, built.optimizer, timed, device)
            del built
        for round_index in range(spec.rounds):
            for position, variant in enumerate(round_order(spec.variants, round_index)):
                trace = None
                if spec.trace_dir:
                    trace = Path(spec.trace_dir) / f"{name}_{variant}_r{round_index}_rank{rank}.json"
                record = _run_one(spec, config, variant, batches, device, trace, captured)
                record.update(round=round_index, position=position, batch_bytes=batch_nbytes(batches[0]))
                records.append(record)
                if rank == 0:
                    print(f"[bench] {name} round {round_index} {variant}: {_brief(record)}", flush=True)
    return records


def _prime(config: BenchConfig, batches: list, device: torch.device, seed: int) -> None:
    """A few untimed steps of the plain loop and both SparseDist pipelines, so that one-time costs
    of the process (thread pools, allocator arenas, first fx trace) land on no measured run."""
    for variant in _PRIMERS:
        built = build_model(config, device=device, seed=seed, store_dir=_store_dir(config.name))
        _drain(make_runner(variant, built.model, built.optimizer, device), iter(batches[:4]))
        dist.barrier()


def _run_one(
    spec: RunSpec,
    config: BenchConfig,
    variant: str,
    batches: list,
    device: torch.device,
    trace: Path | None,
    captured: bound.Captured | None = None,
) -> dict:
    record: dict[str, Any] = {"config": config.name, "variant": variant, "status": "ok"}
    built = build_model(disk_bound.bound_config(config, variant), device=device, seed=spec.seed,
                        store_dir=_store_dir(config.name))  # fmt: skip
    caches = [c for m in built.model.modules() if hasattr(m, "tiered_kernels") for k in m.tiered_kernels()
              for c in k.caches]  # fmt: skip
    for cache in caches:
        cache.store.drop_page_cache()  # cold: the run's first reads of every row go to the disk
    if variant.endswith("+free-features"):
        # the flag frees the features of the batches it trains (on CPU, these very objects): keep
        # the shared ones for the variants after it (the copy is in the baseline, not the peak)
        batches = copy.deepcopy(batches)
    dist.barrier()
    baseline = reset_peak(device)
    it = iter(batches)
    kjt_before: list[tuple[float, int]] = []  # the KJT check's clock when the timed steps start

    def on_timed() -> None:
        record.update(_cache_figures(caches))
        kjt_before.append((AgreementClock.kjt_seconds, AgreementClock.kjt_calls))

    try:
        runner = make_runner(variant, built.model, built.optimizer, device, captured=captured)
        timed = _timed_steps(
            runner,
            it,
            warmup=spec.warmup_of(variant),
            steps=spec.steps,
            on_timed=on_timed,
        )
    except Exception as e:
        if variant not in CPU_UNSUPPORTED or device.type != "cpu":
            raise
        # Known: torchrec 1.8's Prefetch pipeline prefetches only on CUDA, and its forward then
        # refuses the batch; its Fused and SemiSync pipelines record CPU tensors on a stream. Both ranks fail
        # at the same point, so they stay in step.
        record.update(status="unsupported", message=f"does not run on CPU ({type(e).__name__}: {e})")
        # It launched input_dist all-to-alls it will never wait for. Free its objects while the
        # process group lives (else the process can abort at exit), and let gloo's barrier wait
        # for every earlier collective.
        del e
        gc.collect()
        dist.barrier()
        return record
    if caches:
        record.update(_cache_figures(caches, since=record, steps=spec.steps))
    times = timed.step_times_s
    record.update(step_times_s=times, peak_bytes=peak(device) - baseline, baseline_bytes=baseline)
    record["agreement_ms"] = 1e3 * timed.agreement_s / len(times)
    record["cpu_ms"] = 1e3 * timed.cpu_s / len(times)
    if kjt_before and (checked := AgreementClock.kjt_calls - kjt_before[0][1]) > 0:
        record["kjt_check_us"] = 1e6 * (AgreementClock.kjt_seconds - kjt_before[0][0]) / checked
    record["schedule"] = runner.schedule()
    tuner = runner.tuner()
    if tuner is not None:
        record["tuner"] = {
            "choice": tuner.choice,
            "reason": tuner.reason,
            "medians_ms": tuner.medians_ms,
            "tuning_steps": tuner.tuning_steps,
            "tuning_steps_by_schedule": tuner.tuning_steps_by_schedule,
        }
    if spec.profile_steps and runner.profile:
        record.update(_profiled_segment(runner, built.model, it, spec, device, trace))
    _drain(runner, it)
    return record


@dataclasses.dataclass(slots=True)
class _Timed:
    step_times_s: list[float]
    agreement_s: float
    """Seconds the timed steps spent in the ranks' agreement (`AgreementClock`)."""
    cpu_s: float
    """Process CPU time (every thread: the prefetch worker's and the store writer's too) over the
    timed steps."""


def _timed_steps(
    runner: Runner, it: Iterator[Any], *, warmup: int, steps: int, on_timed: Callable[[], None] = lambda: None
) -> _Timed:
    """Warm-up steps, `on_timed()`, then the timed steps' durations, agreement and CPU time."""
    for _ in range(warmup):
        runner.step(it)
    on_timed()
    times = []
    agreement_s = AgreementClock.seconds
    cpu_started = time.process_time()
    for _ in range(steps):
        start = time.perf_counter()
        runner.step(it)
        times.append(time.perf_counter() - start)
    return _Timed(times, AgreementClock.seconds - agreement_s, time.process_time() - cpu_started)


def _store_dir(config: str) -> str:
    """A folder per config: configs of different table shapes name their store files alike."""
    path = Path(os.environ.get("BENCH_STORE_DIR") or Path(tempfile.gettempdir()) / "bench-tiered") / config
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def _cache_figures(caches: list, *, since: dict | None = None, steps: int = 1) -> dict[str, float]:
    """Counters of `caches` summed (`since` None), or over the timed steps: this rank's hit rate,
    and per step its store read time and time making rows resident (worker thread included)."""
    now = {
        "hits": sum(c.stats.hits for c in caches),
        "misses": sum(c.stats.misses for c in caches),
        "read_s": sum(c.store.stats.read_seconds for c in caches),
        "prefetch_s": sum(c.stats.prefetch_seconds for c in caches),
    }
    if since is None:
        return {f"_cache_{k}": v for k, v in now.items()}
    d = {k: v - since.pop(f"_cache_{k}") for k, v in now.items()}
    return {
        "cache_hit_rate": d["hits"] / max(d["hits"] + d["misses"], 1),
        "store_read_ms": 1e3 * d["read_s"] / steps,
        "prefetch_ms": 1e3 * d["prefetch_s"] / steps,
    }


def _profiled_segment(
    runner: Runner,
    model: nn.Module,
    it: Iterator[Any],
    spec: RunSpec,
    device: torch.device,
    trace: Path | None,
) -> dict[str, Any]:
    """`spec.profile_steps` steps under the profiler: forward's input_dist wait, labels, tensor peak."""
    inline = timed_input_dist(model) if runner.inline_input_dist else nullcontext()
    with inline, profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(spec.profile_steps):
            runner.step(it)
    summary = summarize_profile(
        prof.events(),
        forward_label=runner.forward_label,
        wait_label=runner.wait_label,
        steps=spec.profile_steps,
    )
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
    return {**dataclasses.asdict(summary), "tensor_peak_bytes": tensor_peak_bytes(prof, device)}


def _drain(runner: Any, it: Any) -> None:
    """Train what is left, in flight or not, so no collective is left pending on any rank."""
    try:
        while True:
            runner.step(it)
    except StopIteration:
        pass


def _brief(record: dict[str, Any]) -> str:
    if record["status"] != "ok":
        return record.get("message", record["status"])
    times = sorted(record["step_times_s"])
    return f"median {times[len(times) // 2] * 1e3:.1f} ms"


def main(argv: list[str]) -> int:
    spec_path, out_path = argv
    spec = RunSpec.from_json(Path(spec_path).read_text())
    _quiet()
    # Two ranks on two cores: one intra-op thread each keeps them from thrashing.
    torch.set_num_threads(1)
    AgreementClock.install()
    rank = int(os.environ["RANK"])
    dist.init_process_group("nccl" if spec.device == "cuda" else "gloo")
    try:
        records = run_rank(spec, rank)
        Path(out_path).write_text(json.dumps(records))
    finally:
        dist.destroy_process_group()
    return 0


def _quiet() -> None:
    # torchrec's planner and DMP warn on every build; the benchmark builds dozens of models.
    warnings.filterwarnings("ignore")
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    logging.getLogger("torch").setLevel(logging.ERROR)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
