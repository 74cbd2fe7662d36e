"""`python -m benchmarks first-step`: time to first output, in fresh processes under real torchrun.

Each round launches one torchrun job per variant (order rotated between rounds), each a new
interpreter with nothing cached: the plain loop's first step, and each pipeline's first
`progress()` from the call to its return (the fill, the rewrite, the groups it makes, the first
batch's step). Also the pipeline's fill alone (its first `progress()` minus the median of steps 2-6)
so that the goal "first step within 2x the plain loop's first step plus the fill" can be read off.
The model is the `demo` benchmark config (`benchmarks/configs.py`).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.report import markdown_table, stamp, text_table, write

__all__ = ["first_step"]

VARIANTS = {
    "plain": ("plain", ""),
    "ours-sparse-dist": ("pipeline", "TrainPipelineSparseDist"),
    "ours-prefetch": ("pipeline", "PrefetchTrainPipelineSparseDist"),
    "torchrec-sparse-dist": ("torchrec", "TrainPipelineSparseDist"),
}
_ROOT = Path(__file__).resolve().parent.parent


def first_step(
    *, variants: list[str], rounds: int, world_size: int, command: str, json: str | None, md: str | None
) -> int:
    names = variants or list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for k in range(rounds):
        for name in names[k % len(names) :] + names[: k % len(names)]:
            runs[name].append(_launch(name, world_size))
    rows = []
    for name in names:
        first = [r["first_ms"] for r in runs[name]]
        later = [r["later_ms"] for r in runs[name]]
        rows.append([name, statistics.median(first), min(first), max(first), statistics.median(later)])
    columns = ["variant", "first step ms (median)", "min", "max", "steps 2-6 ms (median)"]
    shown = [[r[0], *(f"{v:.0f}" for v in r[1:])] for r in rows]
    print(text_table(columns, shown))
    lines = [*stamp(command), "", f"{world_size} ranks, {rounds} rounds, a fresh torchrun job each.", ""]
    lines += markdown_table(columns, shown)
    write({"command": command, "runs": runs}, "\n".join(lines) + "\n", json_path=json, md_path=md)
    return 0


def _launch(name: str, world_size: int) -> dict[str, float]:
    torchrun = Path(sys.executable).parent / "torchrun"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(_ROOT))
    library, cls = VARIANTS[name]
    cmd = [str(torchrun), "--standalone", f"--nproc_per_node={world_size}", "-m", "benchmarks.first_step"]
    done = subprocess.run(
        [*cmd, library, cls or "-"], cwd=_ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{name} failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
    return json.loads(lines[-1])


def _rank(library: str, cls: str) -> None:
    """One rank of one job: build, then time the first step and the next five."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from benchmarks.configs import get_config
    from benchmarks.models import build_model, make_batches

    config = get_config("demo")
    built = build_model(config, device=torch.device("cpu"))
    model, opt = built.model, built.optimizer
    batches = iter(make_batches(config, count=12, rank=rank))
    if library == "plain":

        def step() -> None:
            loss, _ = model(next(batches))
            loss.backward()
            opt.step()
            opt.zero_grad()

    else:
        if library == "pipeline":
            import pipeline as module
        else:
            import torchrec.distributed.train_pipeline as module
        pipe = getattr(module, cls)(model, opt, torch.device("cpu"))

        def step() -> None:
            pipe.progress(batches)

    dist.barrier()
    times = []
    for _ in range(6):  # the first step, then steps 2-6
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    if library != "plain":  # run out the batches in flight: a group destroyed under an
        with contextlib.suppress(StopIteration):  # all-to-all in flight aborts the process
            while True:
                step()
    slowest = torch.tensor([times[0], statistics.median(times[1:])], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if rank == 0:
        first, later = slowest.tolist()
        print(json.dumps({"first_ms": 1e3 * first, "later_ms": 1e3 * later}))
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank(sys.argv[1], sys.argv[2])
