"""A small discrete-event simulation of tasks on lanes that share resources (pure: no torch).

A `Task` runs on one lane (a thread or stream that runs its tasks one at a time, in the order they
were given: the caller's thread, a process group's queue of collectives, the prefetch worker) once
the task before it on that lane and every task it is `after` have finished. While it runs it holds
a fraction of some resources (`uses`: a core, the link); when the running tasks ask for more of a
resource than there is, each of them slows down in proportion (a fluid model of processor sharing:
two transfers on one link each get half of it, a transfer's copies and the compute thread share a
core). A task with no `uses` (a message's latency) runs at full speed whatever else runs.

`simulate` returns when each task started and ended; `attribute` says what the caller's thread
was doing or waiting for over an interval, which is how a pipeline's critical stage is found.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

__all__ = ["Run", "Task", "attribute", "simulate"]

Key = tuple[str, int]
_EPS = 1e-15


@dataclass(frozen=True, slots=True)
class Task:
    """One unit of work of one batch."""

    key: Key
    """(name, batch): unique within one simulation."""
    lane: str
    seconds: float
    """Duration when it gets all it uses."""
    uses: tuple[tuple[str, float], ...] = (("cpu", 1.0),)
    """(resource, fraction of it held at full speed)."""
    after: tuple[Key, ...] = ()
    stage: str = ""
    """What the time counts as (default: the name)."""

    @property
    def label(self) -> str:
        return self.stage or self.key[0]


@dataclass(slots=True)
class Run:
    """The outcome of a simulation: start and end of every task."""

    tasks: dict[Key, Task]
    start: dict[Key, float] = field(default_factory=dict)
    end: dict[Key, float] = field(default_factory=dict)
    lane_before: dict[Key, Key] = field(default_factory=dict)
    """Each task's predecessor on its lane."""


def simulate(tasks: list[Task], capacity: dict[str, float]) -> Run:
    """Run `tasks` (module docstring); `capacity` per resource (a resource not named has 1).

    Raises:
        ValueError: a task waits for an unknown task, or the tasks can never all run (a cycle).
    """
    run = Run(tasks={t.key: t for t in tasks})
    lanes: dict[str, deque[Task]] = {}
    for t in tasks:
        if lanes.get(t.lane):
            run.lane_before[t.key] = lanes[t.lane][-1].key
        lanes.setdefault(t.lane, deque()).append(t)
        for dep in t.after:
            if dep not in run.tasks:
                raise ValueError(f"{t.key} waits for {dep}, which is not a task")
    now, left, active = 0.0, {}, set()
    while True:
        for lane in lanes.values():
            head = lane[0] if lane else None
            if head is not None and head.key not in active and all(d in run.end for d in head.after):
                active.add(head.key)
                run.start[head.key] = now
                left[head.key] = max(head.seconds, 0.0)
        if not active:
            if any(lanes.values()):
                stuck = [lane[0].key for lane in lanes.values() if lane]
                raise ValueError(f"tasks can never run (a cycle?): {stuck}")
            return run
        rates = _rates([run.tasks[k] for k in active], capacity)
        step = min(left[k] / rates[k] for k in active)
        now += step
        for key in list(active):
            left[key] -= rates[key] * step
            if left[key] <= _EPS * max(1.0, now):
                active.discard(key)
                run.end[key] = now
                lanes[run.tasks[key].lane].popleft()


def _rates(running: list[Task], capacity: dict[str, float]) -> dict[Key, float]:
    demand: dict[str, float] = {}
    for t in running:
        for resource, share in t.uses:
            demand[resource] = demand.get(resource, 0.0) + share
    scale = {r: min(1.0, capacity.get(r, 1.0) / d) if d > 0 else 1.0 for r, d in demand.items()}
    return {t.key: min((scale[r] for r, s in t.uses if s > 0), default=1.0) for t in running}


def attribute(run: Run, lane: str, begin: float, end: float) -> dict[str, float]:
    """Seconds of [begin, end] that `lane` spent on each stage: running its own tasks, or waiting,
    charged to whatever it waited for, followed back through what that waited for in turn."""
    out: dict[str, float] = {}
    previous_end = None
    for key, task in run.tasks.items():
        if task.lane != lane or key not in run.start:
            continue
        start, stop = run.start[key], run.end[key]
        if previous_end is not None and start > previous_end:
            _charge_wait(run, task, previous_end, start, begin, end, out, depth=0)
        _add(out, task.label, start, stop, begin, end)
        previous_end = stop
    return out


def _charge_wait(
    run: Run, task: Task, lo: float, hi: float, begin: float, end: float, out: dict[str, float], depth: int
) -> None:
    """Charge [lo, hi] (before `task` could start) to the blocker that finished last, then the
    part before that blocker started to its own blocker, and so on."""
    blockers = [*task.after, *([run.lane_before[task.key]] if task.key in run.lane_before else [])]
    blocker = max(blockers, key=lambda k: run.end[k], default=None)
    if blocker is None or run.end[blocker] <= lo or depth > 50:
        _add(out, "idle", lo, hi, begin, end)
        return
    b_start = run.start[blocker]
    _add(out, run.tasks[blocker].label, max(lo, b_start), hi, begin, end)
    if b_start > lo:
        _charge_wait(run, run.tasks[blocker], lo, b_start, begin, end, out, depth + 1)


def _add(out: dict[str, float], label: str, lo: float, hi: float, begin: float, end: float) -> None:
    seconds = min(hi, end) - max(lo, begin)
    if seconds > 0:
        out[label] = out.get(label, 0.0) + seconds
