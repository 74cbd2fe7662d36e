"""`python -m benchmarks step-path`: what a reader must follow to understand one steady training step,
ours against torchrec's: the files and functions of the pipeline package that one `progress()` call
enters (2 gloo ranks, a benchmark config's model and batches, `demo` by default, the same step of
the same data), counted with `sys.setprofile` over our `pipeline/` and `rewrite/` and over
torchrec's `train_pipeline/`.

`--schedules`: `late` pins torchrec's order (no watch); `decided` is the default whose watch has
decided (pinned before the first step: the state a verdict leaves, no clock runs); `adaptive` is the
default's watch while it watches (its threshold set out of reach, so that at the counted step it
watches still whatever the share: it neither tries early nor ends).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from benchmarks.launch import free_port
from benchmarks.report import markdown_table, stamp, text_table, write

__all__ = ["step_path"]

_ROOT = Path(__file__).resolve().parent.parent


def _rank(
    rank: int, port: int, impl: str, cls: str, config: str, steps: int, schedule: str, queue: Any
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    sys.path.insert(0, str(_ROOT))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from benchmarks.configs import get_config
    from benchmarks.models import build_model, make_batches

    bench = get_config(config)
    built = build_model(bench, device=torch.device("cpu"))
    model, opt = built.model, built.optimizer
    if impl == "ours":
        import pipeline as package

        roots = tuple(str(_ROOT / d) + os.sep for d in ("pipeline", "rewrite"))
        given = "adaptive" if schedule == "decided" else schedule
        watch = package.ScheduleWatch(threshold=0.99, patience=0) if given == "adaptive" else None
        options = package.InputDistOptions(schedule=given, watch=watch)
        pipe = getattr(package, cls)(model, opt, torch.device("cpu"), input_dist=options)
        if schedule == "decided":
            pipe.tuner.pin("decided before the count")
    else:
        from torchrec.distributed import train_pipeline as package

        roots = (os.path.dirname(package.__file__) + os.sep,)
        pipe = getattr(package, cls)(model, opt, torch.device("cpu"))
    it = iter(make_batches(bench, count=steps + 10, rank=rank))
    for _ in range(steps):
        pipe.progress(it)
    funcs: set[tuple[str, str]] = set()

    def seen(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(roots):
            funcs.add((frame.f_code.co_filename, frame.f_code.co_name))

    sys.setprofile(seen)
    pipe.progress(it)
    sys.setprofile(None)
    if rank == 0:
        base = roots[0].rsplit(os.sep, 2)[0]
        queue.put(sorted(f"{os.path.relpath(f, base)}:{name}" for f, name in funcs))
    dist.barrier()
    dist.destroy_process_group()


def _count(impl: str, cls: str, config: str, steps: int, schedule: str) -> list[str]:
    """`file:function` for every function of the package that the counted step entered."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    args = (free_port(), impl, cls, config, steps, schedule, queue)
    ranks = [ctx.Process(target=_rank, args=(r, *args)) for r in range(2)]
    for p in ranks:
        p.start()
    try:
        return queue.get(timeout=600)
    finally:
        for p in ranks:
            p.join(60)
            if p.is_alive():
                p.kill()


def step_path(
    *,
    cls: str,
    config: str,
    steps: int,
    schedules: list[str],
    functions: bool,
    command: str,
    json: str | None,
    md: str | None,
) -> int:
    result: dict[str, Any] = {"command": command, "class": cls, "config": config, "step": steps + 1}
    result["runs"] = {}
    rows = []
    for impl, schedule in [*(("ours", s) for s in schedules), ("torchrec", "torchrec's")]:
        entered = _count(impl, cls, config, steps, schedule)
        files = sorted({name.split(":")[0] for name in entered})
        result["runs"][f"{impl} {schedule}"] = {"files": files, "functions": len(entered), "entered": entered}
        rows.append([impl, schedule, len(files), len(entered)])
    columns = ["pipeline", "schedule", "files", "functions"]
    print(text_table(columns, rows))
    for name, run in result["runs"].items():
        print(f"{name}:", *run["entered" if functions else "files"], sep="\n  ")
    lines = [*stamp(command), "", f"{cls}, step {steps + 1}, 2 gloo ranks, the `{config}` config.", ""]
    lines += markdown_table(columns, rows)
    for name, run in result["runs"].items():
        lines += ["", f"{name}: " + ", ".join(f"`{f}`" for f in run["files"])]
    write(result, "\n".join(lines) + "\n", json_path=json, md_path=md)
    return 0
