"""Entry point: `python -m benchmarks.run [--configs ...] [--link 1gbit] ...` (what `make bench` runs).

Runs every variant of every config on 2 local ranks, prints the table and the issue's targets, and
writes every run to a JSON file and the summary to a Markdown file. Exit status 2 means the
benchmark could not start (bad flag, link emulation unavailable), 1 that a rank failed.
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

from benchmarks.configs import CONFIGS
from benchmarks.launch import LaunchError, launch
from benchmarks.link import LinkUnavailable, emulated_link, parse_rate
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
from benchmarks.spec import VARIANTS, RunSpec

__all__ = ["main", "run_benchmark"]

WORLD_SIZE = 2


def run_benchmark(
    spec: RunSpec, *, link: str | None = None, timeout: float = 3600.0, command: str = ""
) -> dict[str, Any]:
    """Run `spec` on 2 local ranks (behind an emulated `link` rate if given).

    Returns:
        The JSON-ready result: `meta`, every merged `runs` record, `summary` rows and `targets`.

    Raises:
        LinkUnavailable: `link` was asked for and cannot be emulated here.
        LaunchError: a rank failed or timed out.
    """
    started = time.time()
    load_before = os.getloadavg()[0]
    if link is None:
        per_rank = launch(spec, world_size=WORLD_SIZE, timeout=timeout)
    else:
        with emulated_link(link) as emulated:
            per_rank = launch(spec, world_size=WORLD_SIZE, link=emulated, timeout=timeout)
    runs = merge_ranks(per_rank)
    rows = summarize(runs, world_size=WORLD_SIZE)
    meta = {
        "command": command,
        "spec": json.loads(spec.to_json()),
        "link": link,
        "world_size": WORLD_SIZE,
        "host": _host(),
        "versions": ", ".join(f"{p} {_version(p)}" for p in ("torch", "torchrec", "fbgemm-gpu-cpu")),
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "load_before": load_before,
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
            rounds=args.rounds,
            profile_steps=args.profile_steps,
            seed=args.seed,
            trace_dir=args.trace_dir,
        )
    except ValueError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"bench: warning: load average {load:.1f} before start; other work will skew the timings")
    command = shlex.join(["python", "-m", "benchmarks.run", *argv])
    try:
        result = run_benchmark(spec, link=args.link, timeout=args.timeout, command=command)
    except LinkUnavailable as e:
        print(f"bench: cannot emulate the link: {e}", file=sys.stderr)
        return 2
    except LaunchError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 1
    rows = [Row(**r) for r in result["summary"]]
    targets = [Target(**t) for t in result["targets"]]
    print(f"\n{result['meta']['command']}  (link: {args.link or 'loopback'})\n")
    print(table(rows, targets))
    for path, text in (
        (args.json, json.dumps(result, indent=1)),
        (args.md, markdown(rows, targets, result["meta"])),
    ):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    print(f"\nwrote {args.json} and {args.md}")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS), metavar="NAME",
                   help=f"configs to run (default: all of {', '.join(CONFIGS)})")  # fmt: skip
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS, metavar="NAME",
                   help=f"variants to run (default: all of {', '.join(VARIANTS)})")  # fmt: skip
    p.add_argument("--steps", type=int, default=20, help="timed steps per run (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before them (default 5)")
    p.add_argument("--rounds", type=int, default=3, help="repetitions, order rotated (default 3)")
    p.add_argument("--profile-steps", type=int, default=5,
                   help="steps of the separate profiled segment; 0 skips it (default 5)")  # fmt: skip
    p.add_argument("--link", metavar="RATE", help="emulate a link of this tc rate, e.g. 1gbit (root)")
    p.add_argument("--seed", type=int, default=0, help="seeds models and batches (default 0)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before the ranks are killed")
    p.add_argument("--trace-dir", help="write the profiled segments' chrome traces here")
    p.add_argument("--json", default="out/bench/results.json", help="every run, as JSON")
    p.add_argument("--md", default="out/bench/results.md", help="the summary, as Markdown")
    return p


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
