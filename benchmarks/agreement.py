"""Entry point: `python -m benchmarks.agreement` (what `make bench-agreement` runs).

Prices the ranks' per-batch vote, key check and KJT check (`pipeline.ranks`): our Base and our
SparseDist (schedule forced to "late", so that tuning cannot differ between the two) with them and
without them (`+novote`: `agreement=False, check_keys=False, check_kjts=False`), in paired rotated
rounds on 2 ranks over loopback, where a fixed per-step cost shows most. Prints, per config, the
paired ratio with/without (median over rounds, lowest and highest round); the direct cost: time the
agreement's calls take on the training thread per step (`benchmarks.measure.AgreementClock`, slowest
rank), as a fraction of the step; and the key check and the KJT check alone in microseconds per
batch.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time

from benchmarks.paired import paired, round_medians
from benchmarks.run import cpu_busy, run_benchmark
from benchmarks.spec import RunSpec

PAIRS = (("ours-base", "ours-base+novote"), ("ours-sparse-dist@late", "ours-sparse-dist@late+novote"))
CONFIGS = ("demo", "input-dist-heavy", "compute-heavy", "sweep-lo-tiny", "sweep-lo-ids100")


def key_check_us(repeats: int = 2000) -> float:
    """Median microseconds of one `KeyCheck.check` on a DLRM batch of 26 features."""
    import torch
    from torchrec import KeyedJaggedTensor
    from torchrec.datasets.utils import Batch

    from pipeline.ranks import KeyCheck

    keys = [f"cat_{i}" for i in range(26)]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.arange(26 * 512), lengths=torch.ones(26 * 512, dtype=torch.int32)
    )
    batch = Batch(dense_features=torch.rand(512, 13), sparse_features=kjt, labels=torch.rand(512))
    check = KeyCheck()
    check.check(batch)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        check.check(batch)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def kjt_check_us(config_name: str = "demo", count: int = 200, repeats: int = 5) -> float:
    """Median microseconds of one `KJTCheck.check` on `config_name`'s batches (its 26 tables'
    rows, read from the unsharded DLRM: the same configs a sharded one holds)."""
    import torch

    from benchmarks.configs import get_config
    from benchmarks.model import make_batches, table_configs
    from examples.dlrm.model import unsharded_dlrm
    from pipeline.ranks import KJTCheck

    torch.set_num_threads(1)
    config = get_config(config_name)
    tables = table_configs(config)
    model = unsharded_dlrm(tables, embedding_dim=config.embedding_dim, dense_hidden=(8,), over_hidden=(8,))
    batches = make_batches(config, count=count, rank=0)
    check = KJTCheck(model)
    assert check.check(batches[0]) is None
    times = []
    for _ in range(repeats):
        for batch in batches:
            start = time.perf_counter()
            check.check(batch)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def kjt_in_run(runs: list[dict], variant: str) -> tuple[float, float]:
    """Median over rounds of the KJT check's microseconds per batch in the run (slowest rank), and
    of that over the median step."""
    ok = [r for r in runs if r["variant"] == variant and r["status"] == "ok" and "kjt_check_us" in r]
    if not ok:
        return float("nan"), float("nan")
    us = statistics.median(r["kjt_check_us"] for r in ok)
    fraction = statistics.median(r["kjt_check_us"] / (statistics.median(r["step_times_s"]) * 1e6) for r in ok)
    return us, fraction


def direct_fraction(runs: list[dict], variant: str) -> float:
    """Median over rounds of the agreement's time per step (`agreement_ms`) over the median step."""
    fractions = [
        r["agreement_ms"] / (statistics.median(r["step_times_s"]) * 1e3)
        for r in runs
        if r["variant"] == variant and r["status"] == "ok"
    ]
    return statistics.median(fractions) if fractions else float("nan")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks.agreement", description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS))
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args(argv)
    if (busy := cpu_busy()) > 0.2:
        print(f"agreement: warning: CPUs {busy:.0%} busy before start; timings are noisy", file=sys.stderr)
    spec = RunSpec(
        configs=tuple(args.configs),
        variants=tuple(v for pair in PAIRS for v in pair),
        steps=args.steps,
        warmup=args.warmup,
        rounds=args.rounds,
        profile_steps=0,
    )
    command = shlex.join(["python", "-m", "benchmarks.agreement", *argv])
    result = run_benchmark(spec, command=command)
    print(f"\n{command}\n")
    header = f"{'config':18} {'pipeline':24} {'with ms':>8} {'without ms':>10} {'direct':>7}"
    print(f"{header}  with / without [lowest, highest round]")
    worst = worst_direct = 0.0
    for config in args.configs:
        runs = [r for r in result["runs"] if r["config"] == config]
        rounds = round_medians(runs)
        for on, off in PAIRS:
            ratio = paired(rounds, on, off)
            if ratio is None:
                continue
            worst = max(worst, ratio.median)
            with_ms = statistics.median(r[on] for r in rounds.values())
            without_ms = statistics.median(r[off] for r in rounds.values())
            direct = direct_fraction(runs, on)
            worst_direct = max(worst_direct, direct)
            kjt_us, kjt_fraction = kjt_in_run(runs, on)
            print(
                f"{config:18} {on:24} {with_ms:8.2f} {without_ms:10.2f} {direct:7.2%}  "
                f"{ratio.median:.3f} [{ratio.low:.3f}, {ratio.high:.3f}]  "
                f"KJT check {kjt_us:.1f} us/batch = {kjt_fraction:.2%} of a step"
            )
    print(f"\nkey check alone: {key_check_us():.1f} us per batch (26 features)")
    for config in args.configs:
        print(f"KJT check alone: {kjt_check_us(config):.1f} us per batch of {config}")
    print(f"largest median ratio: {worst:.3f} (target <= 1.01)")
    print(f"largest direct cost: {worst_direct:.2%} of a step (target <= 1 %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
