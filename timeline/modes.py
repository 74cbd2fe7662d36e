"""How each run ran its traced steps, in words: the mode of the prefetch stage and the input_dist
schedule, step by step, and where the prefetch stage really ran.

The mode comes from the trace itself: a run recorded by examples/dlrm's ``--profile`` carries, under
the top-level key ``pipeline_steps``, one entry per recorded step, in order, read from the
pipeline object at that step (``examples.dlrm.runners.running_mode``: ``pipeline``, ``prefetch``
and ``prefetch_by``, ``input_dist_schedule`` and ``schedule_by``), so the table cannot say what the
flags asked for but did not run. The profiler records exactly the forwards of its recorded steps,
so the k-th entry is matched with the k-th ``forward#i`` of the trace. Where the prefetch stage's
labels ran is read from their threads: on the forward's thread (inline, or ahead but on the
training thread) or on another (the worker thread).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from timeline.trace import STEPS_KEY, Span

__all__ = ["RunModes", "Segment", "mode_text", "run_modes"]


def mode_text(mode: dict[str, Any]) -> str:
    """One step's mode in words, e.g. ``prefetch ahead (pinned); input_dist early (watch: kept)``."""
    prefetch, schedule = mode.get("prefetch"), mode.get("input_dist_schedule")
    words = [
        "no prefetch stage"
        if prefetch is None
        else f"prefetch {prefetch} ({mode.get('prefetch_by', 'not said how chosen')})",
        "input_dist inside forward"
        if schedule is None
        else f"input_dist {schedule} ({mode.get('schedule_by', 'not said how chosen')})",
    ]
    return "; ".join(words)


@dataclass(frozen=True, slots=True)
class Segment:
    """Consecutive traced steps that ran in one mode."""

    first: int
    """Batch index of the first step's ``forward#i``."""
    last: int
    mode: dict[str, Any]

    @property
    def steps(self) -> str:
        return f"{self.first}-{self.last}" if self.last != self.first else str(self.first)


@dataclass(frozen=True, slots=True)
class RunModes:
    """What one trace says of how its steps ran."""

    pipeline: str | None
    """The pipeline's class, None where the trace does not say."""
    traced: tuple[int, ...]
    """Batch index of every ``forward#i`` in the trace, in order."""
    segments: tuple[Segment, ...]
    """The traced steps by mode; empty where the trace holds no (or no matching) account."""
    unmatched: str | None
    """Why the account was not matched to the steps (None where it was, or where there is none)."""
    prefetch_threads: tuple[int, int]
    """(prefetch labels on a thread other than their batch's forward's, all prefetch labels)."""

    def lines(self) -> list[str]:
        """The account in Markdown lines: pipeline, steps traced, mode per segment, threads."""
        traced = f"forward#{self.traced[0]}-{self.traced[-1]} ({len(self.traced)} steps)"
        head = f"{self.pipeline or 'pipeline not recorded'}, traced {traced}"
        lines = [f"- {head}"]
        if self.unmatched is not None:
            lines.append(f"- mode: {self.unmatched}")
        elif not self.segments:
            lines.append(f"- mode: not in the trace (no top-level '{STEPS_KEY}' list)")
        for segment in self.segments:
            lines.append(f"- forward#{segment.steps}: {mode_text(segment.mode)}")
        away, total = self.prefetch_threads
        if total:
            lines.append(f"- prefetch labels on another thread than their forward's: {away} of {total}")
        return lines

    def short(self) -> str:
        """One line for the picture: the mode of each segment and the steps traced."""
        if not self.segments:
            modes = "mode not recorded"
        else:
            modes = " | ".join(f"#{s.steps}: {mode_text(s.mode)}" for s in self.segments)
        return f"{self.pipeline or 'pipeline ?'}: {modes}"


def run_modes(records: Sequence[Any] | None, spans: Sequence[Span]) -> RunModes:
    """Match the trace's per-step account `records` (``pipeline_steps``, or None) with its forwards.

    A list whose length is not the number of forwards, or whose entries are not objects, is not
    matched: `unmatched` says so, and no mode is claimed.
    """
    forward_thread = {s.batch: s.thread for s in spans if s.stage == "forward"}
    traced = tuple(sorted(forward_thread))
    prefetch = [s for s in spans if s.stage == "prefetch" and s.batch in forward_thread]
    away = sum(1 for s in prefetch if s.thread != forward_thread[s.batch])
    threads = (away, len(prefetch))
    if records is None:
        return RunModes(None, traced, (), None, threads)
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        return RunModes(None, traced, (), f"'{STEPS_KEY}' is not a list of objects", threads)
    pipeline = str(records[-1].get("pipeline")) if records else None
    if len(records) != len(traced):
        why = f"{len(records)} steps described for {len(traced)} forwards in the trace: not matched"
        return RunModes(pipeline, traced, (), why, threads)
    segments: list[Segment] = []
    for batch, mode in zip(traced, records, strict=True):
        if segments and segments[-1].mode == mode:
            segments[-1] = Segment(segments[-1].first, batch, mode)
        else:
            segments.append(Segment(batch, batch, mode))
    return RunModes(pipeline, traced, tuple(segments), None, threads)
