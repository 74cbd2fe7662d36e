"""The one way every suite compares loops, and the one way it prints and writes a table.

Paired over interleaved rounds: in each round every variant runs once, in an order rotated from round
to round, so a round's A/B ratio (or A-B difference) compares two runs made minutes apart on the same
machine state, and slow drift cancels. A figure is reported as the median over rounds with the
spread of the rounds, `median [lowest, highest]`. Every table printed or written says the command,
the machine (CPU model, cores), the rounds and what the spread is.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "Paired",
    "by_round",
    "cell",
    "header",
    "markdown_table",
    "over_rounds",
    "paired",
    "paired_difference",
    "publish",
    "pyplot",
    "save_figure",
    "text_table",
    "write",
]

Rounds = Mapping[Any, Mapping[str, float]]
"""Per round, a figure per variant (e.g. its median step time in ms)."""


@dataclass(kw_only=True, slots=True)
class Paired:
    """A figure over rounds: the median and the lowest and highest round."""

    median: float
    low: float
    high: float
    rounds: int

    def __format__(self, spec: str) -> str:
        """`f"{p:.2f}"`: `median [low, high]`, each formatted with `spec` (default `.3f`)."""
        spec = spec or ".3f"
        return f"{self.median:{spec}} [{self.low:{spec}}, {self.high:{spec}}]"


def over_rounds(values: Sequence[float]) -> Paired | None:
    """The median and range of one figure per round; None for no rounds."""
    if not values:
        return None
    return Paired(median=statistics.median(values), low=min(values), high=max(values), rounds=len(values))


def paired(rounds: Rounds, a: str, b: str) -> Paired | None:
    """A/B in every round that ran both; None if none did."""
    return over_rounds([r[a] / r[b] for r in rounds.values() if a in r and b in r and r[b] > 0])


def paired_difference(rounds: Rounds, a: str, b: str) -> Paired | None:
    """A-B in every round that ran both; None if none did."""
    return over_rounds([r[a] - r[b] for r in rounds.values() if a in r and b in r])


def by_round(runs: list[dict[str, Any]], key: str) -> dict[int, dict[str, float]]:
    """Per round, each variant's `key` from run records with `round`, `variant` and `status` (runs
    that went wrong are left out); `step_ms` is the median of the run's `step_times_s` in ms."""
    out: dict[int, dict[str, float]] = {}
    for r in runs:
        if r["status"] != "ok":
            continue
        value = statistics.median(r["step_times_s"]) * 1e3 if key == "step_ms" else r.get(key)
        if value is not None:
            out.setdefault(r["round"], {})[r["variant"]] = value
    return out


def header(meta: Mapping[str, Any]) -> list[str]:
    """The lines that head every table: command, machine, and where runs were timed, the rounds and
    what the spread is."""
    busy = meta.get("cpu_busy_before")
    lines = [
        f"Command: `{meta['command']}`",
        f"Machine: {meta['machine']}" + ("" if busy is None else f"; CPUs {busy:.0%} busy before the start"),
    ]
    if meta.get("commit"):
        lines.append(f"Commit: {meta['commit']}; started {meta.get('started', 'at an unrecorded time')}")
    if meta.get("cpu_hog"):
        lines.append(f"Beside the ranks: {meta['cpu_hog']}")
    if "rounds" not in meta:  # nothing measured (a replay)
        return lines
    return [
        *lines,
        f"Rounds: {meta['rounds']} (order rotated), {meta['steps']} timed steps per run after "
        f"{meta['warmup']} untimed; {meta.get('where', '')}",
        "Figures: median over rounds [lowest, highest round]; a ratio or difference is taken within "
        "each round (paired), then the median over rounds.",
    ]


def stamp(command: str) -> list[str]:
    """The lines that head a figure file: the command, the machine with the stack's versions, the
    date (docs quote the file, so a reader sees where and when its figures came from)."""
    import datetime

    from benchmarks.measure import commit, machine

    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return [f"Command: `{command}`  ", f"Machine: {machine()}  ", f"Commit: {commit()}  ", f"Date: {today}"]


def cell(value: Any, spec: str) -> str | None:
    """`value` formatted with `spec` for a table cell; None (shown as "-") for no value."""
    return None if value is None else format(value, spec)


def _cells(rows: Sequence[Sequence[Any]]) -> list[list[str]]:
    return [["-" if c is None else str(c) for c in row] for row in rows]


def text_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Aligned columns for the terminal (the first column left-aligned, the rest right)."""
    lines = [list(columns), *_cells(rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(columns))]

    def render(line: list[str]) -> str:
        pairs = enumerate(zip(line, widths, strict=True))
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in pairs)

    return "\n".join([render(lines[0]), "  ".join("-" * w for w in widths), *map(render, lines[1:])])


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A Markdown table (the first column left-aligned, the rest right)."""
    return [
        "| " + " | ".join(columns) + " |",
        "|---|" + "---:|" * (len(columns) - 1),
        *("| " + " | ".join(row) + " |" for row in _cells(rows)),
    ]


def publish(
    result: dict[str, Any],
    title: str,
    columns: Sequence[str],
    cells: Sequence[Sequence[Any]],
    notes: Sequence[str],
    *,
    json_path: str | None,
    md_path: str | None,
    more: Sequence[str] = (),
) -> None:
    """Print the table under the header of `result["meta"]`, with its notes; write the JSON and the
    Markdown (`more` Markdown lines after the notes)."""
    head = header(result["meta"])
    print("\n".join(["", *head, "", text_table(columns, cells), "", *notes]))
    lines = [f"# {title}", "", *(f"{h}  " for h in head), "", *markdown_table(columns, cells), ""]
    lines += [*(f"- {n}" for n in notes), "", *more]
    write(result, "\n".join(lines), json_path=json_path, md_path=md_path)


def pyplot() -> Any:
    """matplotlib's pyplot, drawing to files only (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str) -> None:
    """Lay out, write (its folder made) and close a figure of `pyplot()`; say where."""
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    print(f"wrote {path}")


def write(result: dict[str, Any], markdown: str, *, json_path: str | None, md_path: str | None) -> None:
    """Write the JSON result and the Markdown report where asked; say where."""
    for path, text in ((json_path, json.dumps(result, indent=1, default=asdict)), (md_path, markdown)):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
            print(f"wrote {path}")
