"""``python -m timeline compare BASE PREFETCH -o OUT``: picture and tables of two runs.

Writes ``OUT/timeline.png``, ``OUT/timeline.md`` and ``OUT/timeline.json`` and prints the tables.
A file that is not a usable trace ends the command with one ``error:`` line and exit status 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from timeline.modes import RunModes, run_modes
from timeline.report import (
    Comparison,
    compare_stats,
    comparison_markdown,
    run_markdown,
    to_json,
)
from timeline.stats import RunStats, StepSelection, run_stats, select_steps
from timeline.trace import TraceError, load_trace
from timeline.tracks import Timeline, build_timeline

__all__ = ["CompareResult", "RunAnalysis", "analyse", "compare_traces", "main"]


@dataclass(frozen=True, slots=True)
class RunAnalysis:
    """One trace, analysed."""

    path: str
    timeline: Timeline
    selection: StepSelection
    stats: RunStats
    modes: RunModes
    """How its steps ran, as the trace says (`timeline.modes`)."""


@dataclass(frozen=True, slots=True)
class CompareResult:
    """What ``compare`` produced."""

    runs: tuple[RunAnalysis, RunAnalysis]
    comparison: Comparison
    markdown: str
    png: Path
    markdown_path: Path
    json_path: Path


def analyse(path: str | Path, label: str, *, warmup: int = 2, steps: int = 3) -> RunAnalysis:
    """Load one trace and measure it.

    Args:
        path: Chrome trace (.json or .json.gz) of a pipelined run.
        label: Name of the run in tables and the picture.
        warmup: Steps skipped at the start of the trace.
        steps: Steady-state steps to draw.

    Returns:
        The run's timeline, step selection, table and modes.

    Raises:
        TraceError: The file is not a trace, has no pipeline labels, or no steady-state step.
    """
    trace = load_trace(path)
    timeline = build_timeline(trace, label)
    selection = select_steps(timeline, warmup=warmup, shown=steps)
    modes = run_modes(trace.steps, trace.spans)
    return RunAnalysis(str(path), timeline, selection, run_stats(timeline, selection), modes)


def compare_traces(
    first: str | Path,
    second: str | Path,
    out_dir: str | Path,
    *,
    labels: tuple[str, str] = ("base", "prefetch"),
    warmup: int = 2,
    steps: int = 3,
) -> CompareResult:
    """Analyse two traces and write the PNG, Markdown and JSON tables into ``out_dir``.

    Raises:
        TraceError: Either file is not a usable trace (see :func:`analyse`).
    """
    runs = (
        analyse(first, labels[0], warmup=warmup, steps=steps),
        analyse(second, labels[1], warmup=warmup, steps=steps),
    )
    comparison = compare_stats(runs[0].stats, runs[1].stats)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    png = _render(runs, out / "timeline.png", [_title(r) for r in runs])
    about = [r.modes.lines() for r in runs]
    markdown = "\n".join(
        [
            *(run_markdown(r.stats, a) for r, a in zip(runs, about, strict=True)),
            comparison_markdown(comparison, [r.modes.short() for r in runs]),
        ]
    )
    md_path = out / "timeline.md"
    md_path.write_text(markdown)
    record = to_json([(r.stats, r.selection, r.path, r.modes) for r in runs], comparison)
    json_path = out / "timeline.json"
    json_path.write_text(json.dumps(record, indent=2) + "\n")
    return CompareResult(runs, comparison, markdown, png, md_path, json_path)


def _title(run: RunAnalysis) -> str:
    shown, stats = run.selection.shown, run.stats
    steps = f"steps {shown[0]}-{shown[-1]}" if len(shown) > 1 else f"step {shown[0]}"
    return (
        f"{stats.label} ({stats.device}): {steps}, 0 ms = start of forward#{shown[0]}; "
        f"median step {stats.step_us / 1000:.3f} ms over steps {stats.steady_steps[0]}-"
        f"{stats.steady_steps[-1]}\n{run.modes.short()}"
    )


def _render(runs: Sequence[RunAnalysis], path: Path, titles: list[str]) -> Path:
    # matplotlib is imported only here: the tables must not wait for it.
    from timeline.plot import render_png

    return render_png([(r.timeline, r.selection) for r in runs], path, titles=titles)


def _labels(text: str) -> tuple[str, str]:
    parts = tuple(p.strip() for p in text.split(","))
    if len(parts) != 2 or not all(parts) or parts[0] == parts[1]:
        raise argparse.ArgumentTypeError(f"expected two different names like base,prefetch: {text!r}")
    return parts[0], parts[1]


def _count(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    return parse


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m timeline", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    compare = commands.add_parser("compare", help="picture and tables of two traces")
    compare.add_argument("base", help="trace of the first run (drawn on top)")
    compare.add_argument("prefetch", help="trace of the second run (drawn below)")
    compare.add_argument("-o", "--out", required=True, help="output folder")
    compare.add_argument("--steps", type=_count(1), default=3, help="steady-state steps to draw")
    compare.add_argument("--warmup", type=_count(0), default=2, help="steps skipped at the start")
    compare.add_argument("--labels", type=_labels, default=("base", "prefetch"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        result = compare_traces(
            args.base, args.prefetch, args.out, labels=args.labels, warmup=args.warmup, steps=args.steps
        )
    except (TraceError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(result.markdown)
    print(f"wrote {result.png}, {result.markdown_path}, {result.json_path}")
    return 0
