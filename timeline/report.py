"""Tables of the timeline comparison: one per run and one of differences, as Markdown and JSON.

Times are kept in microseconds (the trace's unit) in the dataclasses and the JSON, and shown in
milliseconds in Markdown. A metric a run does not have (the base pipeline has no input_dist labels,
so no communication numbers) is ``None`` in JSON and ``n/a`` in Markdown.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from timeline.modes import RunModes
from timeline.stats import RunStats, StepSelection
from timeline.tracks import CPU_TRACK_ORDER, GPU_TRACK_ORDER

__all__ = ["Comparison", "Row", "compare_stats", "comparison_markdown", "run_markdown", "to_json"]

DEFINITIONS = {
    "step": "start of pipeline::forward#i to start of pipeline::forward#i+1",
    "step_us": "median step time over the steady-state steps",
    "busy_us": "time a track's boxes cover inside a step, mean over the steady-state steps",
    "outside_labels_us": "CPU time of a step that no pipeline label covers, mean per step",
    "comm.total_us": "end of input_dist::start#i to end of input_dist::wait#i, mean per step",
    "comm.exposed_us": "part of input_dist::wait#i inside forward#i, mean per step",
    "comm.hidden_us": "total - exposed",
    "comm.wait_us": "all input_dist::wait#i time, wherever it lies, mean per step",
    "comm.overlap_ratio": "hidden / total",
}


_COMM_METRICS = (
    ("communication total", "us"),
    ("communication exposed (in forward)", "us"),
    ("communication hidden", "us"),
    ("input_dist wait (anywhere)", "us"),
    ("overlap ratio (hidden/total)", "ratio"),
)


@dataclass(frozen=True, slots=True)
class Row:
    """One metric of both runs."""

    metric: str
    unit: str
    """``us`` for times, ``ratio`` for the overlap ratio."""
    values: tuple[float | None, float | None]

    @property
    def diff(self) -> float | None:
        """Second run minus first run."""
        first, second = self.values
        return None if first is None or second is None else second - first

    @property
    def change(self) -> float | None:
        """Relative change from the first run (0.1 = 10% more)."""
        first = self.values[0]
        diff = self.diff
        return None if diff is None or not first else diff / first


@dataclass(frozen=True, slots=True)
class Comparison:
    """The difference table of two runs."""

    labels: tuple[str, str]
    rows: tuple[Row, ...]


def _metrics(stats: RunStats) -> dict[str, tuple[str, float | None]]:
    metrics: dict[str, tuple[str, float | None]] = {"step time (median)": ("us", stats.step_us)}
    for track, busy in stats.busy_us.items():
        metrics[f"busy: {track}"] = ("us", busy)
    metrics["cpu outside pipeline labels"] = ("us", stats.outside_labels_us)
    comm = stats.comm
    comm_values = (
        (None,) * 5
        if comm is None
        else (comm.total_us, comm.exposed_us, comm.hidden_us, comm.wait_us, comm.overlap_ratio)
    )
    for (name, unit), value in zip(_COMM_METRICS, comm_values, strict=True):
        metrics[name] = (unit, value)
    return metrics


def compare_stats(first: RunStats, second: RunStats) -> Comparison:
    """Line up the metrics of two runs; a metric only one run has gets ``None`` for the other.

    Rows: step time, busy time of every track either run has (in track order), then the rest.
    """
    a, b = _metrics(first), _metrics(second)
    rank: dict[str, int] = {}
    for track in CPU_TRACK_ORDER + GPU_TRACK_ORDER:
        rank.setdefault(f"busy: {track}", len(rank))
    busy = sorted({n for n in [*a, *b] if n.startswith("busy: ")}, key=lambda n: (rank.get(n, 99), n))
    rest = [n for n in a if not n.startswith("busy: ")]
    rows = []
    for name in [rest[0], *busy, *rest[1:]]:
        unit = a[name][0] if name in a else b[name][0]
        values = (a[name][1] if name in a else None, b[name][1] if name in b else None)
        rows.append(Row(name, unit, values))
    return Comparison((first.label, second.label), tuple(rows))


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    if unit == "ratio":
        return f"{value:.1%}"
    return f"{value / 1000:.3f} ms"


def _fmt_diff(row: Row) -> list[str]:
    """Difference and relative change; a ratio's difference is in percentage points."""
    diff, change = row.diff, row.change
    if diff is None:
        return ["n/a", "n/a"]
    if row.unit == "ratio":
        return [f"{diff * 100:+.1f} pp", "-"]
    return [f"{diff / 1000:+.3f} ms", "n/a" if change is None else f"{change:+.1%}"]


def _steps(steps: tuple[int, ...]) -> str:
    return f"{steps[0]}-{steps[-1]}" if len(steps) > 1 else str(steps[0])


def run_markdown(stats: RunStats, about: Sequence[str] = ()) -> str:
    """One run's table in Markdown, with a heading naming its steady-state steps and, under it, the
    lines `about` (how the run ran: `timeline.modes.RunModes.lines`)."""
    lines = [
        f"### {stats.label} ({stats.device}, steady-state steps {_steps(stats.steady_steps)})",
        "",
        *about,
        *([""] if about else []),
        "| metric | value |",
        "|---|---:|",
    ]
    lines += [f"| {name} | {_fmt(value, unit)} |" for name, (unit, value) in _metrics(stats).items()]
    return "\n".join(lines) + "\n"


def comparison_markdown(comparison: Comparison, modes: Sequence[str] = ()) -> str:
    """The difference table in Markdown: both values, second minus first, relative change; under
    the heading, one line per run of `modes` (how each ran: `timeline.modes.RunModes.short`)."""
    first, second = comparison.labels
    lines = [
        f"### {second} vs {first}",
        "",
        *(f"- {label}: {text}" for label, text in zip(comparison.labels, modes, strict=True)),
        *([""] if modes else []),
        f"| metric | {first} | {second} | {second} - {first} | change |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in comparison.rows:
        cells = [_fmt(v, row.unit) for v in row.values] + _fmt_diff(row)
        lines.append(f"| {row.metric} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def to_json(
    runs: list[tuple[RunStats, StepSelection, str, RunModes]], comparison: Comparison
) -> dict[str, Any]:
    """Everything in the tables as a JSON-ready dict (times in microseconds).

    Args:
        runs: (stats, selection, trace path, modes) of each run.
        comparison: Their difference table.
    """
    out_runs = []
    for stats, selection, path, modes in runs:
        record = dataclasses.asdict(stats)
        record["step_times_us"] = {str(k): v for k, v in stats.step_times_us.items()}
        record.update(trace=path, shown_steps=list(selection.shown), modes=dataclasses.asdict(modes))
        out_runs.append(record)
    rows = [
        {
            "metric": row.metric,
            "unit": row.unit,
            **dict(zip(comparison.labels, row.values, strict=True)),
            "diff": row.diff,
            "change": row.change,
        }
        for row in comparison.rows
    ]
    return {
        "units": "microseconds",
        "definitions": DEFINITIONS,
        "runs": out_runs,
        "comparison": {"labels": list(comparison.labels), "rows": rows},
    }
