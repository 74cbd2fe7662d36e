"""Draw runs as stacked track charts on one time axis and save a PNG (matplotlib, Agg canvas).

Each run is one panel, first run on top. A panel has one row per track and shows the steps chosen by
``StepSelection.shown``; its time is re-based to the start of its first shown step, so ``0 ms`` is
``forward#i`` of that run. Every box carries its batch index, which is what makes the pipelining
visible: in one step the copy of batch i+2, the input_dist of batch i+1 and the forward of batch i
sit above each other. Dashed lines mark the step boundaries (starts of forward).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from timeline.stats import StepSelection
from timeline.tracks import Box, Timeline

__all__ = ["STAGE_COLORS", "render_png"]

STAGE_COLORS = {
    "copy": "#4c72b0",
    "input_dist::start": "#dd8452",
    "input_dist::splits": "#e8a33d",
    "in_flight": "#f3d2b8",
    "input_dist::wait": "#c44e52",
    "prefetch": "#8172b3",
    "forward": "#55a868",
    "backward": "#7f9f5f",
    "optimizer": "#937860",
    "unlabelled": "#c8c8c8",
}
_OTHER_COLOR = "#8c8c8c"
_MIN_WIDTH_MS = 1e-3  # zero-length labels still get a visible sliver


def _window(timeline: Timeline, selection: StepSelection) -> tuple[float, float]:
    starts = timeline.step_starts
    return starts[selection.shown[0]], starts[selection.shown[-1] + 1]


def _bar(box: Box, row: int) -> tuple[float, float]:
    """(bottom, height) of a box in track ``row``; collectives alternate halves by batch parity."""
    if box.stage != "in_flight" or box.batch is None:
        return row - 0.38, 0.76
    return (row - 0.38, 0.36) if box.batch % 2 == 0 else (row + 0.02, 0.36)


def _draw_track(ax: Axes, row: int, boxes: list[Box], t0: float, xlim: tuple[float, float]) -> None:
    bars: dict[tuple[str, tuple[float, float]], list[tuple[float, float]]] = defaultdict(list)
    extent: dict[tuple[str, int], list[float]] = {}
    for box in boxes:
        x = (box.start - t0) / 1000
        width = max((box.end - box.start) / 1000, _MIN_WIDTH_MS)
        bars[box.stage, _bar(box, row)].append((x, width))
        if box.batch is not None:
            lo_hi = extent.setdefault((box.stage, box.batch), [x, x + width])
            lo_hi[:] = [min(lo_hi[0], x), max(lo_hi[1], x + width)]
    for (stage, yrange), xranges in bars.items():
        color = STAGE_COLORS.get(stage, _OTHER_COLOR)
        hatch = "///" if stage == "in_flight" else None
        ax.broken_barh(xranges, yrange, facecolors=color, edgecolor="white", hatch=hatch)
    for (stage, batch), (lo, hi) in extent.items():
        lo, hi = max(lo, xlim[0]), min(hi, xlim[1])  # centre the number on the visible part
        bottom, height = _bar(Box(0, 0, stage, batch), row)
        ax.text((lo + hi) / 2, bottom + height / 2, str(batch), ha="center", va="center", fontsize=8)


def _draw_run(
    ax: Axes, run: tuple[Timeline, StepSelection], title: str, xlim: tuple[float, float]
) -> set[str]:
    timeline, selection = run
    t0, t1 = _window(timeline, selection)
    stages: set[str] = set()
    for row, track in enumerate(timeline.tracks):
        boxes = [b for b in track.boxes if b.end >= t0 and b.start < t1]
        stages.update(b.stage for b in boxes)
        _draw_track(ax, row, boxes, t0, xlim)
    for batch in (*selection.shown, selection.shown[-1] + 1):
        x = (timeline.step_starts[batch] - t0) / 1000
        ax.axvline(x, color="#555555", linestyle="--", linewidth=0.8)
        ax.text(x, -0.55, f" forward#{batch}", fontsize=7, va="bottom", color="#555555")
    ax.set_yticks(range(len(timeline.tracks)), [track.name for track in timeline.tracks])
    ax.set_ylim(len(timeline.tracks) - 0.5, -0.9)
    ax.set_title(title, loc="left", fontsize=10)
    ax.set_axisbelow(True)
    ax.grid(axis="x", color="#eeeeee")
    return stages


def _legend_handle(stage: str) -> Patch:
    if stage == "in_flight":
        return Patch(facecolor=STAGE_COLORS[stage], hatch="///", label="input_dist in flight")
    return Patch(facecolor=STAGE_COLORS.get(stage, _OTHER_COLOR), label=stage)


def _x_range(runs: Sequence[tuple[Timeline, StepSelection]]) -> tuple[float, float]:
    """Shared x limits (ms): every shown step, and every work box that overlaps one.

    Collective lifetimes do not widen the axis: they start a step earlier and are cut at the edge.
    """
    lo, hi = 0.0, 0.0
    for timeline, selection in runs:
        t0, t1 = _window(timeline, selection)
        hi = max(hi, (t1 - t0) / 1000)
        for track in (track for track in timeline.tracks if track.busy):
            for box in (b for b in track.boxes if b.end >= t0 and b.start < t1):
                lo, hi = min(lo, (box.start - t0) / 1000), max(hi, (box.end - t0) / 1000)
    pad = 0.02 * (hi - lo)
    return lo - pad, hi + pad


def render_png(
    runs: Sequence[tuple[Timeline, StepSelection]],
    path: str | Path,
    *,
    titles: Sequence[str] | None = None,
) -> Path:
    """Draw the runs one above the other on a shared time axis and save the picture.

    Args:
        runs: (timeline, selection) per run, top to bottom.
        path: Where to write the PNG; parent folders are created.
        titles: One panel title per run (a second line: how the run ran); the run labels when omitted.

    Returns:
        The path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    titles = list(titles) if titles is not None else [t.label for t, _ in runs]
    heights = [max(len(t.tracks), 1) + 1 for t, _ in runs]
    fig = Figure(figsize=(14, 1.2 + 0.42 * sum(heights) + 0.2 * len(runs)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(runs), 1, sharex=True, squeeze=False, height_ratios=heights)[:, 0]
    xlim = _x_range(runs)
    stages: set[str] = set()
    for ax, run, title in zip(axes, runs, titles, strict=True):
        stages |= _draw_run(ax, run, title, xlim)
    axes[-1].set_xlim(*xlim)
    axes[-1].set_xlabel("time from the start of the first shown step (ms)")
    order = [s for s in STAGE_COLORS if s in stages] + sorted(stages - STAGE_COLORS.keys())
    handles = [_legend_handle(stage) for stage in order]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 9), fontsize=8)
    fig.savefig(path, dpi=110)
    return path
