"""Entry point: `python -m benchmarks.sweep` (what `make bench-sweep` runs).

Runs every point of `benchmarks.points` (or `--points`), grouped by link rate so that each link is
set up once: the plain loop, our Base, SparseDist (auto and each forced schedule) and Prefetch,
torchrec's SparseDist, and the bound's compute-alone and comm-alone. Writes `sweep.json` (every run),
`sweep.md` (table, forced schedules, checks) and `sweep.png` to `--out`, and prints the table.
Exit status 2: could not start (bad flag, link emulation unavailable); 1: a rank failed.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import sweep_report
from benchmarks.launch import LaunchError
from benchmarks.link import LinkUnavailable
from benchmarks.points import POINTS, SweepPoint, get_point
from benchmarks.run import cpu_busy, run_benchmark
from benchmarks.spec import BOUND_VARIANTS, FORCED_VARIANTS, RunSpec

__all__ = ["SWEEP_VARIANTS", "main", "run_sweep"]

SWEEP_VARIANTS = (
    "plain",
    "ours-base",
    "ours-sparse-dist",
    "ours-prefetch",
    "torchrec-sparse-dist",
    *FORCED_VARIANTS,
    *BOUND_VARIANTS,
)


def by_link(points: list[SweepPoint]) -> dict[str | None, list[SweepPoint]]:
    """Points grouped by link, in first-seen order (one emulated link, one launch per group)."""
    groups: dict[str | None, list[SweepPoint]] = {}
    for p in points:
        groups.setdefault(p.link, []).append(p)
    return groups


def run_sweep(points: list[SweepPoint], args: argparse.Namespace, command: str) -> dict[str, Any]:
    """Run the points; returns the JSON-ready result (meta, runs, points)."""
    started = time.time()
    runs, busy, meta = [], {}, {}
    for link, group in by_link(points).items():
        spec = RunSpec(
            configs=tuple(p.name for p in group),
            variants=SWEEP_VARIANTS,
            steps=args.steps,
            warmup=args.warmup,
            auto_warmup=args.auto_warmup,
            rounds=args.rounds,
            profile_steps=0,
            seed=args.seed,
        )
        print(f"[sweep] {link or 'loopback'}: {', '.join(p.name for p in group)}", flush=True)
        result = run_benchmark(spec, link=link, timeout=args.timeout, command=command)
        runs += result["runs"]
        meta = result["meta"]
        busy[link or "loopback"] = result["meta"]["cpu_busy_before"]
    results = [
        sweep_report.analyse(
            [r for r in runs if r["config"] == p.name],
            name=p.name,
            link=p.link,
            description=p.config.description,
        )
        for p in points
    ]
    meta = {
        "command": command,
        "host": meta.get("host", ""),
        "versions": meta.get("versions", ""),
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "duration_s": time.time() - started,
        "steps": args.steps,
        "warmup": args.warmup,
        "auto_warmup": args.auto_warmup,
        "rounds": args.rounds,
        "cpu_busy": ", ".join(f"{k} {v:.0%}" for k, v in busy.items()),
        "busy_warning": any(v > 0.2 for v in busy.values()),
    }
    return {"meta": meta, "runs": runs, "points": results}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    try:
        points = [get_point(n) for n in args.points] if args.points else list(POINTS)
    except ValueError as e:
        print(f"sweep: {e}", file=sys.stderr)
        return 2
    if (busy := cpu_busy()) > 0.2:
        print(f"sweep: warning: CPUs {busy:.0%} busy before start; other work skews timings", file=sys.stderr)
    command = shlex.join(["python", "-m", "benchmarks.sweep", *argv])
    try:
        result = run_sweep(points, args, command)
    except LinkUnavailable as e:
        print(
            f"sweep: cannot emulate the link: {e}; run only loopback points with --points lo-...",
            file=sys.stderr,
        )
        return 2
    except LaunchError as e:
        print(f"sweep: {e}", file=sys.stderr)
        return 1
    _write(result, Path(args.out))
    return 0


def _write(result: dict[str, Any], out: Path) -> None:
    points, meta = result["points"], result["meta"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(
        json.dumps({**result, "points": [sweep_report.as_dict(p) for p in points]}, indent=1)
    )
    (out / "sweep.md").write_text(sweep_report.markdown(points, meta))
    title = f"{meta['command']}  ({meta['started']}, CPUs busy before: {meta['cpu_busy']})"
    sweep_report.plot(points, str(out / "sweep.png"), title)
    print(f"\n{meta['command']}  ({meta['duration_s']:.0f} s)\n")
    print(sweep_report.table(points))
    print()
    for c in sweep_report.checks(points):
        verdict = "n/a" if c.met is None else ("met" if c.met else "MISSED")
        print(f"  {verdict:6} {c.name} ({c.point}): {c.measured}")
    if meta["busy_warning"]:
        print(f"\nwarning: CPUs were busy before start ({meta['cpu_busy']}): figures are noisy")
    print(f"\nwrote {out}/sweep.json, sweep.md and sweep.png")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sweep", description=__doc__.splitlines()[0])
    p.add_argument("--points", nargs="+", metavar="NAME",
                   help=f"points to run (default all: {', '.join(pt.name for pt in POINTS)})")  # fmt: skip
    p.add_argument("--steps", type=int, default=20, help="timed steps per run (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before them (default 5)")
    p.add_argument("--auto-warmup", type=int, default=75,
                   help="untimed steps for the auto-tuning variants (default 75: covers tuning)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=3, help="rounds per point, order rotated (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seeds models and batches (default 0)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before a link's ranks are killed")
    p.add_argument("--out", default="out/sweep", help="directory for sweep.json/.md/.png (default out/sweep)")
    return p


if __name__ == "__main__":
    sys.exit(main())
