"""What a step costs: per-step wall and process CPU time of each loop on a tiny model, where there is
nothing to hide, so every microsecond a pipeline adds over the plain loop is its host overhead.

    python -m benchmarks.overhead --world-size 1 --rounds 5 --steps 300
    python -m benchmarks.overhead --world-size 2
    python -m benchmarks.overhead --profile ours-sparse-dist   # cProfile, function by function

The model is issue 22's tiny one (`benchmarks.tiny_model`: 4 tables of 1,000 rows x 8, batch 64,
one linear layer). Every variant has its own copy of the model (same seed) and its own infinite iterator;
in each round every variant runs a block of `--steps` steps, in an order rotated from round to round,
so drift of the machine falls on all variants alike. The figures are per-step medians over rounds of
the block's wall time and of the process CPU time (all threads: gloo's and the pipeline's too). At
world size 2 each rank runs the same blocks in lockstep and the slower rank's figure is reported.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import logging
import os
import pstats
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.paired import paired_difference
from benchmarks.tiny_model import Feed, build

__all__ = ["VARIANTS", "main", "report"]

_OPTIONAL = tuple(
    f"ours-{kind}+{opt}" for kind in ("base", "sparse-dist", "prefetch") for opt in ("nocheck", "novote")
)
VARIANTS = (
    "plain",
    "ours-base",
    "ours-sparse-dist",
    "ours-prefetch",
    "ours-fused-sparse-dist",
    "torchrec-base",
    "torchrec-sparse-dist",
)


def _runner(variant: str) -> Callable[[], Any]:
    from torchrec.distributed import train_pipeline as torchrec_pipelines

    import pipeline as ours

    model, opt = build()
    feed = Feed(_rank())
    cpu = torch.device("cpu")
    if variant == "plain":

        def step() -> Any:
            batch = next(feed)
            opt.zero_grad()
            loss, out = model(batch)
            loss.backward()
            opt.step()
            return out

        return step
    classes = {
        "ours-base": ours.TrainPipelineBase,
        "ours-sparse-dist": ours.TrainPipelineSparseDist,
        "ours-prefetch": ours.PrefetchTrainPipelineSparseDist,
        "ours-fused-sparse-dist": ours.TrainPipelineFusedSparseDist,
        "torchrec-base": torchrec_pipelines.TrainPipelineBase,
        "torchrec-sparse-dist": torchrec_pipelines.TrainPipelineSparseDist,
        "torchrec-prefetch": torchrec_pipelines.PrefetchTrainPipelineSparseDist,
    }
    name, _, option = variant.partition("+")
    extra = {"nocheck": {"check_kjts": False}, "novote": {"agreement": False, "check_keys": False}}
    pipe = classes[name](model, opt, cpu, **extra.get(option, {}))
    return lambda: pipe.progress(feed)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _measure(variants: list[str], *, rounds: int, steps: int, warmup: int) -> dict[str, dict[str, list]]:
    import torch.distributed as dist

    runners = {v: _runner(v) for v in variants}
    for v in variants:  # first-batch costs (rewrite, input dist creation) and the tuner's trials
        for _ in range(warmup):
            runners[v]()
    out: dict[str, dict[str, list]] = {v: {"wall_ms": [], "cpu_ms": []} for v in variants}
    for k in range(rounds):
        shift = k % len(variants)
        for v in variants[shift:] + variants[:shift]:
            if dist.get_world_size() > 1:
                dist.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(steps):
                runners[v]()
            out[v]["wall_ms"].append((time.perf_counter() - wall) / steps * 1e3)
            out[v]["cpu_ms"].append((time.process_time() - cpu) / steps * 1e3)
    return out


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, path: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    logging.getLogger("torchrec").setLevel(logging.ERROR)  # the planner's dry-run warnings
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        if args.profile:
            result: Any = _profile(args.profile, steps=args.steps, warmup=args.warmup)
        else:
            result = _measure(list(args.variants), rounds=args.rounds, steps=args.steps, warmup=args.warmup)
        with open(f"{path}.{rank}", "w") as f:
            json.dump(result, f)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _profile(variant: str, *, steps: int, warmup: int) -> list[tuple[str, float, float, int]]:
    """cProfile of `steps` steps: (function, own ms/step, cumulative ms/step, calls/step)."""
    step = _runner(variant)
    for _ in range(warmup):
        step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = []
    for (file, line, name), (_cc, calls, own, cum, _callers) in stats.items():
        where = _short(file)
        rows.append((f"{where}:{line}({name})", own / steps * 1e3, cum / steps * 1e3, calls // steps))
    return sorted(rows, key=lambda r: -r[1])


def _short(file: str) -> str:
    if "site-packages/" in file:
        return file.split("site-packages/", 1)[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.relpath(file, root) if file.startswith(root) else os.path.basename(file)


def _spawn(args: argparse.Namespace) -> list[Any]:
    import tempfile

    import torch.multiprocessing as mp

    from benchmarks.launch import free_port

    with tempfile.TemporaryDirectory(prefix="overhead-") as tmp:
        path = os.path.join(tmp, "result")
        mp.start_processes(
            _rank_main,
            args=(args.world_size, free_port(), args, path),
            nprocs=args.world_size,
            start_method="spawn",
        )
        results = []
        for r in range(args.world_size):
            with open(f"{path}.{r}") as f:
                results.append(json.load(f))
        return results


def _rounds(results: list[dict[str, dict[str, list]]], key: str) -> dict[int, dict[str, float]]:
    """Per round and variant, the slower rank's per-step figure."""
    variants = list(results[0])
    rounds = len(results[0][variants[0]][key])
    return {k: {v: max(r[v][key][k] for r in results) for v in variants} for k in range(rounds)}


def report(results: list[dict[str, dict[str, list]]]) -> str:
    """The Markdown table: medians per step, and each loop's paired difference to the plain loop."""
    cpu, wall = _rounds(results, "cpu_ms"), _rounds(results, "wall_ms")
    lines = [
        "| loop | wall ms/step | CPU ms/step | CPU over plain [rounds] | wall over plain [rounds] |",
        "|---|---:|---:|---|---|",
    ]
    for v in results[0]:
        med_cpu = statistics.median(r[v] for r in cpu.values())
        med_wall = statistics.median(r[v] for r in wall.values())
        d_cpu, d_wall = paired_difference(cpu, v, "plain"), paired_difference(wall, v, "plain")
        lines.append(f"| {v} | {med_wall:.3f} | {med_cpu:.3f} | {d_cpu:+} | {d_wall:+} |")
    for ours_v, theirs in (("ours-base", "torchrec-base"), ("ours-sparse-dist", "torchrec-sparse-dist")):
        a, b = paired_difference(cpu, ours_v, "plain"), paired_difference(cpu, theirs, "plain")
        if a is not None and b is not None and b.median > 0:
            lines.append(f"\n{ours_v}'s CPU overhead / {theirs}'s: {a.median / b.median:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overhead", description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300, help="steps per block (per round and variant)")
    parser.add_argument("--warmup", type=int, default=120, help="untimed steps per variant before round 1")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=list(VARIANTS),
        choices=(*VARIANTS, "torchrec-prefetch", *_OPTIONAL),
        help="also: a variant of ours with +nocheck (check_kjts=False) or +novote (agreement and key "
        "check off)",
    )
    parser.add_argument("--profile", metavar="VARIANT", help="cProfile one variant instead (rank 0's)")
    parser.add_argument("--top", type=int, default=30, help="rows of the profile")
    parser.add_argument("--sort", choices=("own", "cum"), default="own", help="profile rows by")
    parser.add_argument(
        "--only",
        nargs="*",
        default=[],
        metavar="PREFIX",
        help="profile rows of these paths only, e.g. pipeline/",
    )
    parser.add_argument("--json", help="write the raw per-round figures here")
    args = parser.parse_args(argv)
    if "plain" not in args.variants and not args.profile:
        args.variants.insert(0, "plain")
    results = _spawn(args)
    if args.profile:
        print(f"| function | own ms/step | cum ms/step | calls/step |  ({args.profile}, rank 0)")
        print("|---|---:|---:|---:|")
        rows = [r for r in results[0] if not args.only or any(p in r[0] for p in args.only)]
        rows.sort(key=lambda r: -r[1 if args.sort == "own" else 2])
        for name, own, cum, calls in rows[: args.top]:
            print(f"| {name} | {own:.4f} | {cum:.4f} | {calls} |")
        return 0
    print(
        f"world size {args.world_size}, {args.rounds} rounds x {args.steps} steps, medians "
        "(the slower rank's)"
    )
    print(report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
