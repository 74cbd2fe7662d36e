"""Entry point: `python -m benchmarks.run [--configs ...] [--link 1gbit] ...` (what `make bench` runs).

Runs every variant of every config on 2 local ranks (`--world-size`; `--device cuda` puts one rank on
each GPU), prints the table and the issue's targets, and writes every run to a JSON file and the
summary to a Markdown file. Exit status 2 means the benchmark could not start (bad flag, link
emulation unavailable), 1 that a rank failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from benchmarks.configs import CONFIGS, GPU_CONFIGS, SMALL_CONFIGS
from benchmarks.launch import LaunchError, launch
from benchmarks.link import LinkUnavailable, emulated_link, parse_rate
from benchmarks.points import POINTS
from benchmarks.report import (
    Row,
    Target,
    check_targets,
    markdown,
    merge_ranks,
    rows_as_dicts,
    summarize,
    table,
)
from benchmarks.spec import ALL_VARIANTS, VARIANTS, RunSpec

__all__ = ["cpu_busy", "main", "run_benchmark"]

WORLD_SIZE = 2


def run_benchmark(
    spec: RunSpec,
    *,
    link: str | None = None,
    timeout: float = 3600.0,
    command: str = "",
    world_size: int = WORLD_SIZE,
) -> dict[str, Any]:
    """Run `spec` on `world_size` local ranks (behind an emulated `link` rate if given).

    Returns:
        The JSON-ready result: `meta`, every merged `runs` record, `summary` rows and `targets`.

    Raises:
        LinkUnavailable: `link` was asked for and cannot be emulated here.
        LaunchError: a rank failed or timed out.
    """
    started = time.time()
    busy_before = cpu_busy()
    if link is None:
        per_rank = launch(spec, world_size=world_size, timeout=timeout)
    else:
        with emulated_link(link) as emulated:
            per_rank = launch(spec, world_size=world_size, link=emulated, timeout=timeout)
    runs = merge_ranks(per_rank)
    rows = summarize(runs, world_size=world_size)
    meta = {
        "command": command,
        "spec": json.loads(spec.to_json()),
        "link": link,
        "world_size": world_size,
        "host": _host(),
        "versions": ", ".join(
            f"{p} {_version(p)}" for p in ("torch", "torchrec", "fbgemm-gpu-cpu", "fbgemm-gpu")
        ),
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "cpu_busy_before": round(busy_before, 3),
        "duration_s": round(time.time() - started, 1),
    }
    return {"meta": meta, "runs": runs, **rows_as_dicts(rows, check_targets(rows))}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    try:
        if args.link:
            parse_rate(args.link)
        spec = RunSpec(
            configs=tuple(args.configs),
            variants=tuple(args.variants),
            steps=args.steps,
            warmup=args.warmup,
            auto_warmup=args.auto_warmup,
            rounds=args.rounds,
            profile_steps=args.profile_steps,
            seed=args.seed,
            trace_dir=args.trace_dir,
            device=args.device,
        )
        if args.device == "cuda":
            _check_gpus(args.world_size)
    except ValueError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    busy = cpu_busy()
    if busy > 0.2:
        print(f"bench: warning: CPUs {busy:.0%} busy before start; other work skews timings", file=sys.stderr)
    command = shlex.join(["python", "-m", "benchmarks.run", *argv])
    try:
        result = run_benchmark(
            spec, link=args.link, timeout=args.timeout, command=command, world_size=args.world_size
        )
    except LinkUnavailable as e:
        print(f"bench: cannot emulate the link: {e}", file=sys.stderr)
        return 2
    except LaunchError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # ranks and link are gone by now: launch and emulated_link clean up
        print("bench: interrupted", file=sys.stderr)
        return 130
    _report(result, json_path=Path(args.json), md_path=Path(args.md))
    return 0


def _report(result: dict[str, Any], *, json_path: Path, md_path: Path) -> None:
    """Print the table and targets; write the JSON and the Markdown summary."""
    rows = [Row(**r) for r in result["summary"]]
    targets = [Target(**t) for t in result["targets"]]
    print(f"\n{result['meta']['command']}  (link: {result['meta']['link'] or 'loopback'})\n")
    print(table(rows, targets, world_size=result["meta"]["world_size"]))
    for path, text in (
        (json_path, json.dumps(result, indent=1)),
        (md_path, markdown(rows, targets, result["meta"])),
    ):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    print(f"\nwrote {json_path} and {md_path}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    points = [pt.name for pt in POINTS]
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), metavar="NAME",
                   choices=[*CONFIGS, *SMALL_CONFIGS, *GPU_CONFIGS, *points],
                   help=f"configs to run (default: all of {', '.join(CONFIGS)}; also the sweep's "
                        "sweep-* points, see benchmarks/points.py)")  # fmt: skip
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=ALL_VARIANTS, metavar="NAME",
                   help=f"variants to run (default: all of {', '.join(VARIANTS)}; also "
                        f"{', '.join(ALL_VARIANTS[len(VARIANTS):])})")  # fmt: skip
    p.add_argument("--steps", type=int, default=30, help="timed steps per run (default 30)")
    p.add_argument(
        "--warmup",
        type=int,
        default=20,
        help="untimed steps before them (default 20)",
    )
    p.add_argument(
        "--auto-warmup",
        type=int,
        default=55,
        help="untimed steps for our SparseDist and Prefetch, whose input_dist_schedule='auto' tunes "
        "during its first steps, at most 54 (default 55)",
    )
    p.add_argument("--rounds", type=int, default=4, help="repetitions, order rotated (default 4)")
    p.add_argument("--profile-steps", type=int, default=5,
                   help="steps of the separate profiled segment; 0 skips it (default 5)")  # fmt: skip
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu (gloo, the default) or cuda (nccl, one GPU per rank)")  # fmt: skip
    p.add_argument("--world-size", type=int, default=WORLD_SIZE, help=f"ranks (default {WORLD_SIZE})")
    p.add_argument("--link", metavar="RATE", help="emulate a link of this tc rate, e.g. 1gbit (root)")
    p.add_argument("--seed", type=int, default=0, help="seeds models and batches (default 0)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before the ranks are killed")
    p.add_argument("--trace-dir", help="write the profiled segments' chrome traces here")
    p.add_argument("--json", default="out/bench/results.json", help="every run, as JSON")
    p.add_argument("--md", default="out/bench/results.md", help="the summary, as Markdown")
    return p


def _check_gpus(world_size: int) -> None:
    import torch

    if torch.cuda.device_count() < world_size:
        raise ValueError(
            f"--device cuda needs a GPU per rank: {world_size} rank(s), {torch.cuda.device_count()} GPU(s) "
            "here; pass --world-size"
        )


def cpu_busy(interval: float = 0.5) -> float:
    """Fraction of all CPUs' time spent busy over the next `interval` seconds (from /proc/stat)."""

    def sample() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return sum(fields) - idle, sum(fields)

    busy0, total0 = sample()
    time.sleep(interval)
    busy1, total1 = sample()
    return (busy1 - busy0) / max(1, total1 - total0)


def _host() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, Linux {platform.release()}"


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    sys.exit(main())
