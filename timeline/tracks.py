"""Turn a trace into tracks of boxes: one track per stage on CPU, one per CUDA stream role on GPU.

On CPU every track is one stage label (``copy``, ``input_dist::start``, ``forward``, ...), plus a
derived track ``input_dist (in flight)`` that shows each batch's collective from the end of its
``input_dist::start`` to the end of its ``input_dist::wait`` - the time gloo's threads work while the
main thread does something else.

On GPU each kernel is traced to the innermost stage label around its CPU launch (through the
``correlation`` id), and each stream is named after the stages whose kernels it mostly runs:
``copy`` -> memcpy, ``input_dist::*`` -> data_dist, ``prefetch`` -> prefetch, the rest -> default.
Every kernel is one box; kernels that no label covers keep ``batch=None``.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from timeline.trace import Span, Trace

__all__ = [
    "IN_FLIGHT",
    "Box",
    "Timeline",
    "Track",
    "build_timeline",
    "collective_lifetimes",
    "union_length",
]

IN_FLIGHT = "input_dist (in flight)"
CPU_TRACK_ORDER = (
    "copy",
    "input_dist::start",
    "input_dist::splits",
    IN_FLIGHT,
    "input_dist::wait",
    "prefetch",
    "forward",
    "backward",
    "optimizer",
)
GPU_TRACK_ORDER = ("memcpy", "data_dist", "prefetch", "default", "other")
STREAM_OF_STAGE = {
    "copy": "memcpy",
    "input_dist::start": "data_dist",
    "input_dist::splits": "data_dist",
    "input_dist::wait": "data_dist",
    "prefetch": "prefetch",
    "forward": "default",
    "backward": "default",
    "optimizer": "default",
}


@dataclass(frozen=True, slots=True)
class Box:
    """One interval drawn in a track."""

    start: float
    end: float
    stage: str
    """Stage that produced it (``in_flight`` for a collective, ``unlabelled`` on GPU)."""
    batch: int | None


@dataclass(frozen=True, slots=True)
class Track:
    """A row of the picture."""

    name: str
    boxes: tuple[Box, ...]
    busy: bool = True
    """False for a derived track (collective lifetime) whose boxes are not work on a thread."""


@dataclass(frozen=True, slots=True)
class Timeline:
    """One run, ready to measure and draw."""

    label: str
    device: str
    """``cpu`` (tracks are stages) or ``cuda`` (tracks are streams)."""
    spans: tuple[Span, ...]
    tracks: tuple[Track, ...]
    step_starts: dict[int, float]
    """batch -> start of its forward: the CPU label, or on GPU its first forward kernel."""


def union_length(intervals: Iterable[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of ``intervals`` clipped to ``[lo, hi)``."""
    total, reach = 0.0, lo
    for start, end in sorted(intervals):
        start, end = max(start, reach), min(end, hi)
        if end > start:
            total += end - start
            reach = end
    return total


def collective_lifetimes(spans: Iterable[Span]) -> dict[int, tuple[float, float]]:
    """batch -> (end of its last input_dist::start, end of its last input_dist::wait)."""
    launched: dict[int, float] = {}
    waited: dict[int, float] = {}
    for span in spans:
        table = {"input_dist::start": launched, "input_dist::wait": waited}.get(span.stage)
        if table is not None:
            table[span.batch] = max(table.get(span.batch, span.end), span.end)
    both = launched.keys() & waited.keys()
    return {b: (launched[b], waited[b]) for b in sorted(both) if waited[b] >= launched[b]}


def _ordered(names: Iterable[str], order: tuple[str, ...]) -> list[str]:
    rank = {name: i for i, name in enumerate(order)}
    return sorted(set(names), key=lambda n: (rank.get(n, len(order)), n))


def _cpu_tracks(spans: tuple[Span, ...]) -> tuple[Track, ...]:
    by_stage: dict[str, list[Box]] = defaultdict(list)
    for s in spans:
        by_stage[s.stage].append(Box(s.start, s.end, s.stage, s.batch))
    for batch, (start, end) in collective_lifetimes(spans).items():
        by_stage[IN_FLIGHT].append(Box(start, end, "in_flight", batch))
    names = _ordered(by_stage, CPU_TRACK_ORDER)
    return tuple(Track(n, tuple(by_stage[n]), busy=n != IN_FLIGHT) for n in names)


def _attribute(spans: tuple[Span, ...], queries: list[tuple[float, Any, int]]) -> dict[int, Span]:
    """For each (ts, thread, key), the innermost span on ``thread`` (any, if None) holding ts."""
    spans_of: dict[Any, list[Span]] = defaultdict(list)
    for span in spans:  # already sorted by (start, -end): parents before children
        spans_of[span.thread].append(span)
        spans_of[None].append(span)
    found: dict[int, Span] = {}
    for thread in {q[1] for q in queries}:
        candidates, stack, j = spans_of.get(thread, []), [], 0
        for ts, _, key in sorted(q for q in queries if q[1] == thread):
            while j < len(candidates) and candidates[j].start <= ts:
                while stack and stack[-1].end <= candidates[j].start:
                    stack.pop()
                stack.append(candidates[j])
                j += 1
            while stack and stack[-1].end < ts:
                stack.pop()
            if stack:
                found[key] = stack[-1]
    return found


def _gpu_tracks(trace: Trace) -> tuple[Track, ...]:
    kernels = trace.kernels
    queries = [
        (*trace.launches[k.correlation], i) for i, k in enumerate(kernels) if k.correlation in trace.launches
    ]
    owner = _attribute(trace.spans, queries)
    # Backward kernels are launched by autograd's own thread: fall back to any labelled thread.
    missing = [(ts, None, key) for ts, _, key in queries if key not in owner]
    owner.update(_attribute(trace.spans, missing))
    votes: dict[int, Counter[str]] = defaultdict(Counter)
    for i, span in owner.items():
        votes[kernels[i].stream][STREAM_OF_STAGE.get(span.stage, "default")] += 1
    streams = {k.stream for k in kernels}
    role = {s: votes[s].most_common(1)[0][0] if votes[s] else "other" for s in streams}
    tracks: dict[str, list[Box]] = defaultdict(list)
    for i, k in enumerate(kernels):
        span = owner.get(i)
        stage, batch = (span.stage, span.batch) if span else ("unlabelled", None)
        tracks[role[k.stream]].append(Box(k.start, k.end, stage, batch))
    return tuple(Track(n, tuple(tracks[n])) for n in _ordered(tracks, GPU_TRACK_ORDER))


def _forward_starts(tracks: tuple[Track, ...]) -> dict[int, float]:
    starts: dict[int, float] = {}
    for track in tracks:
        for box in track.boxes:
            if box.stage == "forward" and box.batch is not None:
                starts[box.batch] = min(starts.get(box.batch, box.start), box.start)
    return dict(sorted(starts.items()))


def build_timeline(trace: Trace, label: str) -> Timeline:
    """Tracks and step starts of one run.

    A trace with GPU kernels of which some trace back to ``pipeline::forward`` is drawn per stream
    and timed by its first forward kernel per batch; any other trace is drawn per CPU stage.

    Args:
        trace: A loaded trace.
        label: Name of the run in tables and the picture (e.g. ``base``).

    Returns:
        The run's timeline.
    """
    if trace.kernels:
        gpu = _gpu_tracks(trace)
        starts = _forward_starts(gpu)
        if starts:
            return Timeline(label, "cuda", trace.spans, gpu, starts)
    cpu = _cpu_tracks(trace.spans)
    return Timeline(label, "cpu", trace.spans, cpu, _forward_starts(cpu))
