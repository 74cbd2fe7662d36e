"""Entry point: `python -m benchmarks.memory_flags`: what each of torchrec's memory flags frees.

Our SparseDist (schedule forced to "late", so that tuning cannot differ between runs) without any
flag and with each of `enable_inplace_copy_batch`, `free_features_storage_early`,
`clear_data_dist_inputs` and `enqueue_batch_after_forward` on alone, in rotated rounds on 2 ranks
over loopback, on a config whose input batches are large (`input-dist-heavy`: 5 MiB a batch, ~100
ids per feature), so that freed features would show. Prints per variant the median over rounds of
the two peaks `benchmarks.run` measures (slower rank): RSS growth over the run (what the OS sees,
allocator caches included) and the peak of live tensor bytes in the profiled segment (the CPU
counterpart of CUDA's max allocated), each also as a difference from the no-flag run.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys

from benchmarks.run import cpu_busy, run_benchmark
from benchmarks.spec import MEMORY_FLAGS, MEMORY_VARIANTS, RunSpec

BASE = "ours-sparse-dist@late"
MIB = 1024 * 1024


def medians(runs: list[dict], variant: str) -> tuple[float, float, float]:
    """(step ms, RSS MiB, tensor MiB) of `variant`, each the median over its rounds."""
    ok = [r for r in runs if r["variant"] == variant and r["status"] == "ok"]
    if not ok:
        return float("nan"), float("nan"), float("nan")
    step = statistics.median(statistics.median(r["step_times_s"]) * 1e3 for r in ok)
    rss = statistics.median(r["peak_bytes"] / MIB for r in ok)
    tensors = statistics.median(r.get("tensor_peak_bytes", float("nan")) / MIB for r in ok)
    return step, rss, tensors


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks.memory_flags", description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", default=["input-dist-heavy"])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    if (busy := cpu_busy()) > 0.2:
        print(f"memory_flags: warning: CPUs {busy:.0%} busy before start; RSS is noisier", file=sys.stderr)
    spec = RunSpec(
        configs=tuple(args.configs),
        variants=(BASE, *MEMORY_VARIANTS),
        steps=args.steps,
        warmup=args.warmup,
        rounds=args.rounds,
        profile_steps=5,
    )
    command = shlex.join(["python", "-m", "benchmarks.memory_flags", *argv])
    result = run_benchmark(spec, command=command)
    print(f"\n{command}\n")
    columns = f"{'step ms':>8} {'RSS MiB':>8} {'+RSS':>6} {'tensor MiB':>10} {'+tensor':>8}"
    print(f"{'config':18} {'flag':30} {columns}")
    names = {BASE: "(none)"} | {f"{BASE}{s}": flag for s, flag in MEMORY_FLAGS.items()}
    for config in args.configs:
        runs = [r for r in result["runs"] if r["config"] == config]
        _, base_rss, base_tensors = medians(runs, BASE)
        for variant in (BASE, *MEMORY_VARIANTS):
            step, rss, tensors = medians(runs, variant)
            print(
                f"{config:18} {names[variant]:30} {step:8.2f} {rss:8.1f} {rss - base_rss:+6.1f} "
                f"{tensors:10.2f} {tensors - base_tensors:+8.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
