"""The numbers of the timeline tables: step time, busy time per track, and hidden communication.

Definitions (docs/timeline.md says the same with a picture):

- *step i* runs from the start of ``forward#i`` to the start of ``forward#i+1``.
- *steady-state steps* are the steps after the first ``warmup`` ones whose window still sees a
  ``copy`` start, i.e. the pipeline is still being fed (the drain at the end of the data is left
  out; a run without copy labels keeps every step after the warm-up).
- *step time* is the median step over the steady-state steps.
- *busy time* of a track is the time covered by its boxes inside a step window, averaged over the
  steady-state steps. *Outside labels* is the CPU time of a step (between the CPU starts of
  ``forward#i`` and ``forward#i+1``) that no pipeline label covers: data loading, zero_grad, logging.
- *communication* of batch i (CPU labels, also on GPU) lives from the end of
  ``input_dist::start#i`` to the end of ``input_dist::wait#i``; the part of ``input_dist::wait#i``
  spent inside ``forward#i`` is *exposed*, the rest is *hidden*. Times are means per steady-state
  step, so hidden = total - exposed, and the *overlap ratio* is hidden / total.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

from timeline.trace import Span, TraceError
from timeline.tracks import Timeline, collective_lifetimes, union_length

__all__ = ["CommStats", "RunStats", "StepSelection", "run_stats", "select_steps"]


@dataclass(frozen=True, slots=True)
class StepSelection:
    """Which steps of a run are measured and which are drawn."""

    steps: tuple[int, ...]
    """Every step: a batch whose forward and the next batch's forward are both in the trace."""
    steady: tuple[int, ...]
    """Steady-state steps, measured in the tables."""
    shown: tuple[int, ...]
    """Consecutive steady-state steps drawn in the picture: of all such runs of the asked length,
    the one whose total time is closest to that many median steps (the earliest on a tie)."""


@dataclass(frozen=True, slots=True)
class CommStats:
    """Input all-to-all time per steady-state step (means, in microseconds)."""

    total_us: float
    """Collective lifetime: end of input_dist::start#i to end of input_dist::wait#i."""
    exposed_us: float
    """Part of input_dist::wait#i inside forward#i: the model stood still for it."""
    hidden_us: float
    """total - exposed: communication that ran while the thread did other work."""
    wait_us: float
    """All input_dist::wait#i time, wherever it lies (inside prefetch, too)."""
    overlap_ratio: float
    """hidden / total (1.0 when total is 0)."""
    batches: int
    """Number of steady-state batches with both input_dist labels."""


@dataclass(frozen=True, slots=True)
class RunStats:
    """The table of one run."""

    label: str
    device: str
    steady_steps: tuple[int, ...]
    step_us: float
    """Median step time over the steady-state steps."""
    step_times_us: dict[int, float]
    """Every step's time, warm-up and drain included."""
    busy_us: dict[str, float]
    """Track -> mean busy time per steady-state step."""
    outside_labels_us: float
    """Mean CPU time per steady-state step that no pipeline label covers."""
    comm: CommStats | None
    """None when the run has no input_dist labels (the base pipeline)."""


def _fed(timeline: Timeline, lo: float, hi: float) -> bool:
    return any(
        box.stage == "copy" and lo <= box.start < hi for track in timeline.tracks for box in track.boxes
    )


def select_steps(timeline: Timeline, *, warmup: int = 2, shown: int = 3) -> StepSelection:
    """Pick the steady-state steps of a run and the few to draw.

    Args:
        timeline: The run.
        warmup: Steps skipped at the start of the trace (pipeline fill, first-call costs).
        shown: How many steady-state steps to draw.

    Returns:
        The selection.

    Raises:
        TraceError: No step is left in steady state.
    """
    starts = timeline.step_starts
    steps = tuple(b for b in starts if b + 1 in starts)
    has_copy = any(box.stage == "copy" for track in timeline.tracks for box in track.boxes)
    first = min(starts)
    steady = tuple(
        b for b in steps if b >= first + warmup and (not has_copy or _fed(timeline, starts[b], starts[b + 1]))
    )
    if not steady:
        raise TraceError(
            f"{timeline.label}: {len(steps)} step(s) in the trace (forward#{first}.."
            f"#{max(starts)}), none in steady state after {warmup} warm-up step(s); "
            "record more steps or lower --warmup"
        )
    return StepSelection(steps, steady, _typical(steady, starts, max(shown, 1)))


def _typical(steady: tuple[int, ...], starts: dict[int, float], count: int) -> tuple[int, ...]:
    median = statistics.median(starts[b + 1] - starts[b] for b in steady)
    windows = [steady[i : i + count] for i in range(max(len(steady) - count, 0) + 1)]
    runs = [w for w in windows if w[-1] - w[0] == len(w) - 1]
    if not runs:  # no consecutive run that long: the first steps
        return steady[:count]

    def distance(run: tuple[int, ...]) -> float:
        return abs(starts[run[-1] + 1] - starts[run[0]] - len(run) * median)

    return min(runs, key=distance)


def _intervals(spans: list[Span]) -> list[tuple[float, float]]:
    return [(s.start, s.end) for s in spans]


def _comm_stats(spans: tuple[Span, ...], batches: tuple[int, ...]) -> CommStats | None:
    lifetimes = collective_lifetimes(spans)
    by_key: dict[tuple[str, int], list[Span]] = defaultdict(list)
    for span in spans:
        by_key[span.stage, span.batch].append(span)
    totals, exposed, waits = [], [], []
    for b in (b for b in batches if b in lifetimes):
        waited = _intervals(by_key["input_dist::wait", b])
        totals.append(lifetimes[b][1] - lifetimes[b][0])
        waits.append(union_length(waited, float("-inf"), float("inf")))
        inside = 0.0
        for fwd in by_key["forward", b]:
            inside += union_length(waited, fwd.start, fwd.end)
        exposed.append(min(inside, totals[-1]))
    if not totals:
        return None
    total, stalled = statistics.fmean(totals), statistics.fmean(exposed)
    ratio = (total - stalled) / total if total > 0 else 1.0
    return CommStats(total, stalled, total - stalled, statistics.fmean(waits), ratio, len(totals))


def _outside_labels(spans: tuple[Span, ...], steps: tuple[int, ...]) -> float:
    forward: dict[int, float] = {}
    for span in (s for s in spans if s.stage == "forward"):
        forward[span.batch] = min(forward.get(span.batch, span.start), span.start)
    labelled = [(s.start, s.end) for s in spans]
    gaps = [
        forward[b + 1] - forward[b] - union_length(labelled, forward[b], forward[b + 1])
        for b in steps
        if b in forward and b + 1 in forward
    ]
    return statistics.fmean(gaps) if gaps else 0.0


def run_stats(timeline: Timeline, selection: StepSelection) -> RunStats:
    """Measure one run over its steady-state steps (see the module docstring for definitions).

    Args:
        timeline: The run.
        selection: Its steps, from :func:`select_steps`.

    Returns:
        The run's table.
    """
    starts = timeline.step_starts
    windows = [(starts[b], starts[b + 1]) for b in selection.steady]
    busy = {}
    for track in (track for track in timeline.tracks if track.busy):
        boxes = [(box.start, box.end) for box in track.boxes]
        busy[track.name] = statistics.fmean(union_length(boxes, lo, hi) for lo, hi in windows)
    return RunStats(
        label=timeline.label,
        device=timeline.device,
        steady_steps=selection.steady,
        step_us=statistics.median(hi - lo for lo, hi in windows),
        step_times_us={b: starts[b + 1] - starts[b] for b in selection.steps},
        busy_us=busy,
        outside_labels_us=_outside_labels(timeline.spans, selection.steady),
        comm=_comm_stats(timeline.spans, selection.steady),
    )
