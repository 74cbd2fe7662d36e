"""Peak memory in flight per pipeline class on a GPU: our hand-off (the keep-alive), the record_stream
hand-off it replaced, and torchrec's class of the same name. Memory, not time: no benchmark.

    PYTHONPATH=.:$PYTHONPATH python scripts/gpu/memory.py [--config gpu-large] [--steps 30]
        [--classes NAME ...] [--json FILE] [--check]

For each class and variant, one rank (NCCL) builds the config's model from `benchmarks` (the same
seed each time), resets the CUDA peak statistics, runs `steps` steps of the pipeline on the
config's batches (outputs dropped as they come), and reports `torch.cuda.max_memory_allocated`
over those steps minus what was allocated before them (the model and its optimizer state): the
batches in flight, their activations and what the hand-offs keep. Ours also report the most
objects the keep-alive held at once. The JSON is written again after every run, so a run cut short
keeps the rows before it. `--check` exits 1 unless, in every class, the keep-alive's peak is at most
record_stream's (the event-ordered hand-offs hold no more in flight). `--device cpu` is a dry run of
the same code (no figures).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
from typing import Any

sys.path.insert(0, os.getcwd())

import torch

CLASSES = (
    "TrainPipelineBase",
    "TrainPipelineSparseDist",
    "PrefetchTrainPipelineSparseDist",
    "TrainPipelineFusedSparseDist",
    "TrainPipelineSemiSync",
    "EvalPipelineSparseDist",
    "StagedTrainPipeline",
)
"""The classes measured by default (PT2 and CompAutograd compile for minutes: ask for them)."""
VARIANTS = ("keep-alive", "record-stream", "torchrec")


def measure(name: str, variant: str, config: Any, steps: int, device: torch.device) -> dict:
    """One class and variant: the peak bytes in flight over `steps` steps, and what was kept."""
    from benchmarks.models import build_model, make_batches

    built = build_model(config, device=device)
    model, opt = built.model, built.optimizer
    if name.startswith("Eval"):
        model.eval()
    batches = make_batches(config, count=steps, rank=0)
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if on_gpu else 0
    streams = _streams(variant, device)
    count = _run(name, variant, model, opt, device, batches, streams)
    if on_gpu:
        torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base if on_gpu else 0
    kept = None if streams is None else streams.keep_alive.peak
    del model, opt, built, batches, streams
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()
    return {"class": name, "variant": variant, "steps": count, "peak_mb": peak / 2**20, "kept_peak": kept}


def _streams(variant: str, device: torch.device) -> Any:
    import pipeline

    if variant == "torchrec" or device.type != "cuda":
        return None
    return pipeline.CudaStreams(device, handoff=variant)


def _run(name: str, variant: str, model, opt, device, batches: list, streams: Any) -> int:
    """Steps run, outputs dropped as they come."""
    if name == "StagedTrainPipeline":
        return _staged(variant, model, opt, device, batches, streams)
    if variant == "torchrec":
        from torchrec.distributed.train_pipeline import train_pipelines as source
    else:
        import pipeline as source
    options = {} if streams is None else {"streams": streams}
    pipe = getattr(source, name)(model, opt, device, **options)
    it, count = iter(batches), 0
    while True:
        try:
            pipe.progress(it)
        except StopIteration:
            return count
        count += 1


def _staged(variant: str, model, opt, device, batches: list, streams: Any) -> int:
    if variant == "torchrec":
        from torchrec.distributed.train_pipeline.pipeline_stage import PipelineStage, SparseDataDistUtil
        from torchrec.distributed.train_pipeline.train_pipelines import StagedTrainPipeline
    else:
        from pipeline import PipelineStage, SparseDataDistUtil, StagedTrainPipeline
    side = (lambda: torch.cuda.Stream(device)) if device.type == "cuda" else (lambda: None)
    memcpy, data_dist = (streams.memcpy, streams.data_dist) if streams is not None else (side(), side())
    ours = {} if streams is None else {"streams": streams}
    sdd = SparseDataDistUtil(model, data_dist, **ours)
    copy = PipelineStage(name="copy", runnable=lambda b: b.to(device, non_blocking=True), stream=memcpy)
    pipe = StagedTrainPipeline([copy, sdd.start_sparse_data_dist_stage()], **ours)
    it, count = iter(batches), 0
    while (batch := pipe.progress(it)) is not None:
        opt.zero_grad()
        loss, _ = model(batch)
        torch.sum(loss).backward()
        opt.step()
        count += 1
    sdd.detach()
    return count


def table(rows: list[dict]) -> str:
    """A markdown table: per class, each variant's peak and the two ratios."""
    by = {(r["class"], r["variant"]): r for r in rows}
    lines = [
        "| class | keep-alive MB | record_stream MB | torchrec MB | keep-alive / record_stream "
        "| keep-alive / torchrec | objects kept (peak) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in dict.fromkeys(r["class"] for r in rows):
        mb = {v: by.get((name, v), {}).get("peak_mb") for v in VARIANTS}
        cells = [f"{mb[v]:.0f}" if mb[v] is not None else "-" for v in VARIANTS]
        kept = by.get((name, "keep-alive"), {}).get("kept_peak")
        lines.append(
            f"| {name} | {' | '.join(cells)} | {_ratio(mb, 'keep-alive', 'record-stream')} "
            f"| {_ratio(mb, 'keep-alive', 'torchrec')} | {kept} |"
        )
    return "\n".join(lines)


def check(rows: list[dict]) -> tuple[list[str], bool]:
    """Per class: is the keep-alive's peak at most record_stream's? A line per class and one in all,
    and whether every class holds (a class without both figures does not)."""
    by = {(r["class"], r["variant"]): r["peak_mb"] for r in rows}
    lines, held = [], 0
    names = list(dict.fromkeys(r["class"] for r in rows))
    for name in names:
        keep, record = by.get((name, "keep-alive")), by.get((name, "record-stream"))
        if keep is None or record is None:
            lines.append(f"MEMORY check {name}: not measured with both hand-offs")
        elif keep <= record:
            held += 1
            lines.append(f"MEMORY check {name}: keep-alive {keep:.1f} MB <= record_stream {record:.1f} MB")
        else:
            lines.append(
                f"MEMORY check {name}: keep-alive {keep:.1f} MB > record_stream {record:.1f} MB, "
                f"{keep - record:.1f} MB more in flight"
            )
    lines.append(f"MEMORY check: keep-alive at most record_stream in {held} of {len(names)} classes")
    return lines, held == len(names)


def _write(path: str | None, config: str, steps: int, rows: list[dict]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"config": config, "steps": steps, "rows": rows}, f, indent=1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ratio(mb: dict, a: str, b: str) -> str:
    return f"{mb[a] / mb[b]:.2f}" if mb[a] and mb[b] else "-"


def main(argv: list[str]) -> int:
    import torch.distributed as dist

    from benchmarks.configs import get_config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="gpu-large", help="a benchmarks config")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--classes", nargs="+", default=list(CLASSES))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run")
    parser.add_argument("--json", help="write the rows here (again after every run)")
    parser.add_argument("--check", action="store_true", help="exit 1 unless keep-alive <= record_stream")
    args = parser.parse_args(argv)
    config = get_config(args.config)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    rows = []
    for name in args.classes:
        for variant in args.variants:
            try:
                rows.append(measure(name, variant, config, args.steps, device))
                print(f"MEMORY {name} {variant}: {rows[-1]}", flush=True)
            except Exception as e:  # one variant failing (torchrec's, on this stack) leaves the rest
                print(f"MEMORY {name} {variant}: failed: {type(e).__name__}: {e}", flush=True)
            _write(args.json, args.config, args.steps, rows)
    print(table(rows))
    lines, held = check(rows)
    print("\n".join(lines), flush=True)
    dist.destroy_process_group()
    return 1 if args.check and not held else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
