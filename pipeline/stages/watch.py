"""`ScheduleWatch`: the default input_dist schedule, "adaptive". It runs torchrec's order ("late")
and watches what the job's own steps show anyway: the step time, and how long the host blocked on
the input all-to-alls (the splits wait and, in forward, the values wait), each read with a clock
around a call the pipeline makes anyway. Each rank's figure rides on its status in the batch's fused
splits all-to-all (`pipeline.ranks.word`), so every rank reads every rank's figures for the same
batch and makes the same decision at the same step, with no collective of its own.

The rule (its constants come from measurements: docs/reference.md, "The default schedule"):

1. Watching, under "late": each rank publishes the median, over its last `window` steps, of the
   time it blocked on the input all-to-alls over the step time. When the ranks' mean has reached
   `threshold` for `window + 1` batches in a row (so in two windows that share no step), every
   rank moves to "early" at the next step (the splits waited before forward, the
   all-to-alls on a process group of their own, created at that step).
2. Trying: the first `settle` steps under "early" are not timed; over the next `verify` steps each
   rank publishes the median step over the median of the `verify` steps before the switch. If every
   rank's ratio is at most `1 - margin`, and on every rank at least `sure` of the verified steps are
   shorter than its median before, "early" is kept; else every rank goes back to "late" at the next
   step and the watch ends: no second try in this job.
3. Kept, or back: no clock runs any more.

Where the statuses cannot ride (one rank, `agreement=False`, a class that admits batches itself),
the ranks have no figures to agree on and torchrec's order is kept (`pin`).
"""

from __future__ import annotations

import enum
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from pipeline.ranks.word import observed
from pipeline.stages import watch_text as text
from pipeline.stages.wait_clock import WaitClock

__all__ = ["ScheduleWatch", "WatchPhase"]


_UNSURE = 4.0
"""Added to a rank's published ratio where too few of its steps after the switch were shorter than
its median before (a ratio itself stays under 4)."""


class WatchPhase(enum.Enum):
    WATCHING = "watching"
    TRYING = "trying"
    KEPT = "kept"
    BACK = "back"
    PINNED = "pinned"


_FINAL = (WatchPhase.KEPT, WatchPhase.BACK, WatchPhase.PINNED)


class ScheduleWatch:
    """Chooses the input_dist schedule from the job's own steps (see the module).

    Args:
        window: steps per observation of the share blocked (the median is taken over them).
        verify: steps timed under "early" before the verdict, compared with as many steps before
            the switch.
        warmup: steps not observed at the start (the first batches rewrite, vote and fuse).
        threshold: the ranks' mean share of the step the host blocks on the input all-to-alls
            under "late" at which "early" is tried, once it has held for `window + 1` batches in a
            row: a steady wait over two windows, not a burst (two ranks sharing two cores wait on
            each other for a while at times).
        settle: untimed steps after the switch (the first creates the process group).
        margin: the gain every rank must see for "early" to be kept (0.05: 5 % faster).
        sure: and the share of the verified steps shorter than the median step before the switch,
            on every rank (0.75 of 20: 15 steps; by chance alone, once in 50): short steps on a busy
            machine vary by tens of percent from one window to the next, and a median alone
            would keep a schedule that is not faster.
        clock: seconds, monotonic (tests inject a fake one).
    """

    def __init__(
        self,
        *,
        window: int = 8,
        verify: int = 20,
        warmup: int = 8,
        threshold: float = 0.5,
        settle: int = 2,
        margin: float = 0.05,
        sure: float = 0.75,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if min(window, verify) < 3 or min(warmup, settle) < 0 or not (0 < threshold < 1 and 0 <= margin < 1):
            raise ValueError(f"bad watch settings: window {window}, threshold {threshold}, margin {margin}")
        if not 0 <= sure <= 1:
            raise ValueError(f"bad watch settings: sure {sure}")
        self.window, self.threshold, self.settle, self.margin = window, threshold, settle, margin
        self.verify, self.warmup, self.sure = verify, warmup, sure
        """The settings (see Args), read by `pipeline.stages.watch_text`."""
        self._high = 0
        """Consecutive batches whose figures (the ranks' mean share) reached the threshold."""
        self._clock = clock
        self.schedule = "late"
        """The schedule in use."""
        self.phase = WatchPhase.WATCHING
        self.waits = WaitClock(clock)
        """Where the input_dist waits are timed (None-ed by `active_clock` once the watch ends)."""
        self._samples: deque[tuple[float, float, float]] = deque(maxlen=window)
        """(step, waited, idle) seconds of the last `window` steps under "late" (`WaitClock`)."""
        self._late: deque[float] = deque(maxlen=verify)
        """The last `verify` step times under "late" (what the steps after a switch are compared to)."""
        self._before: list[float] = []
        self._after: list[float] = []
        self._skip = 0
        self._last: float | None = None
        self._pending: str | None = None
        self._published = 0
        self.steps = 0
        """Training steps begun (`step` calls)."""
        self.decisions: list[tuple[int, str]] = []
        """(step, what was seen and done), in order."""
        self.shares: list[float] = []
        """The ranks' published shares at the switch (one per rank), empty before it."""
        self.ratios: list[float] = []
        """The ranks' step ratios after/before the switch, at the verdict."""
        self.note: Callable[[str], None] | None = None
        """Told each decision's sentence (the rewrite report's notes)."""

    # -- what the pipeline calls ---------------------------------------------------------------

    def step(self) -> str:
        """At the start of each training step: the schedule to run it under."""
        self.steps += 1
        if self._pending is None and self.phase in _FINAL:
            return self.schedule  # the hot path once decided: no clock
        now = self._clock()
        self.waits.thread = threading.get_ident()
        blocked = self.waits.take()
        if self._last is not None and self.steps > self.warmup + 1:
            self._record(now - self._last, *blocked)
        self._last = now
        if self._pending is not None:
            self.schedule, self._pending = self._pending, None
        self._published = self._observation()
        return self.schedule

    def interrupt(self) -> None:
        """An eval step, or a step that ended abnormally: do not time across it."""
        self._last = None
        self.waits.take()

    @property
    def active_clock(self) -> WaitClock | None:
        """The clock the input_dist waits report to, while the watch still watches or tries."""
        return None if self.phase in _FINAL else self.waits

    def observation(self) -> int:
        """This rank's figure for the batch started now (`pipeline.ranks.word.observed`; 0: none yet)."""
        return self._published

    def received(self, observations: list[int]) -> None:
        """Every rank's figure for one batch (the same list on every rank): decide where they suffice."""
        if self._pending is not None or self.phase in _FINAL or not observations or 0 in observations:
            return
        values = [(o - 1) / 1000 for o in observations]
        if self.phase is WatchPhase.WATCHING:
            share = statistics.fmean(values)
            self._high = self._high + 1 if share >= self.threshold else 0
            if self._high > self.window:
                self._switch(values, share)
        elif self.phase is WatchPhase.TRYING:
            self._verdict(values)

    def pin(self, reason: str) -> None:
        """Keep torchrec's order without watching (nothing to agree on; `reason` says why)."""
        self.schedule, self.phase, self._pending = "late", WatchPhase.PINNED, None
        self._decide(text.pinned(reason))

    # -- what users read -----------------------------------------------------------------------

    @property
    def choice(self) -> str | None:
        """The schedule kept, once the watch has ended (None while it watches or tries)."""
        return self.schedule if self.phase in _FINAL else None

    @property
    def reason(self) -> str | None:
        """The last decision, in words."""
        return self.decisions[-1][1] if self.decisions else None

    @property
    def share(self) -> float | None:
        """This rank's median share of the step blocked on the input all-to-alls over the last
        `window` steps under "late" (None before a full window)."""
        return self._share()

    @property
    def tuning(self) -> bool:
        """A schedule other than the one kept runs only to be verified."""
        return self.phase is WatchPhase.TRYING

    @property
    def medians_ms(self) -> dict[str, float]:
        """This rank's median step before and after the switch, in ms (empty before a verdict)."""
        if not (self._before and len(self._after) >= self.verify):
            return {}
        return {"late": 1e3 * statistics.median(self._before), "early": 1e3 * statistics.median(self._after)}

    @property
    def tuning_steps_by_schedule(self) -> dict[str, int]:
        """Steps run under "early" only to verify it (none where it was kept)."""
        if self.phase is WatchPhase.BACK:
            return {"early": self.settle + self.verify + 1}
        return {}

    def __repr__(self) -> str:
        return text.watch_repr(self)

    def state_dict(self) -> dict[str, Any]:
        """The decision, to save with a checkpoint: a watch that loads it does not try again. While
        watching or trying, the state says so, and a restarted job watches from the start."""
        return {"phase": self.phase.value, "schedule": self.schedule, "decisions": list(self.decisions)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a saved decision (from the next step on). A state saved while watching or trying
        leaves the watch as it is."""
        if not state:
            return
        phase = WatchPhase(state["phase"])
        if phase not in _FINAL:
            return
        if state["schedule"] not in ("late", "early"):
            raise ValueError(f"a schedule watch's state names schedule {state['schedule']!r}")
        self.phase, self.schedule, self._pending = phase, state["schedule"], None
        self.decisions = [tuple(d) for d in state["decisions"]]

    # -- the rule ------------------------------------------------------------------------------

    def _record(self, step_s: float, waited_s: float, idle_s: float) -> None:
        if self.phase is WatchPhase.WATCHING:
            self._samples.append((step_s, waited_s, idle_s))
            self._late.append(step_s)
        elif self.phase is WatchPhase.TRYING:
            if self._skip > 0:
                self._skip -= 1
            elif len(self._after) < self.verify:
                self._after.append(step_s)

    def _share(self) -> float | None:
        if len(self._samples) < self.window:
            return None
        return statistics.median((w + i) / s if s > 0 else 0.0 for s, w, i in self._samples)

    @property
    def parts(self) -> tuple[float, float] | None:
        """Of `share`, this rank's median share in the input all-to-alls' waits and off the CPU in
        backward, over the same window (None before a full window)."""
        if len(self._samples) < self.window:
            return None
        return (
            statistics.median(w / s if s > 0 else 0.0 for s, w, _ in self._samples),
            statistics.median(i / s if s > 0 else 0.0 for s, _, i in self._samples),
        )

    def _observation(self) -> int:
        if self.phase is WatchPhase.WATCHING:
            return observed(self._share())
        if self.phase is WatchPhase.TRYING and len(self._after) >= self.verify:
            ratio = statistics.median(self._after) / statistics.median(self._before)
            return observed(ratio if self.faster_steps >= self.sure else ratio + _UNSURE)
        return 0

    @property
    def faster_steps(self) -> float:
        """The share of this rank's verified steps shorter than its median step before the switch;
        0 before the verification window is full."""
        if len(self._after) < self.verify or not self._before:
            return 0.0
        before = statistics.median(self._before)
        return sum(a < before for a in self._after) / len(self._after)

    def _switch(self, shares: list[float], share: float) -> None:
        self.shares = shares
        waits, idle = self.parts or (0.0, 0.0)
        self._before = list(self._late)
        self._after, self._pending, self.phase = [], "early", WatchPhase.TRYING
        # the step that decides runs on under "late": its time is not the new schedule's
        self._skip = self.settle + 1
        self._decide(text.switched(self, share, waits, idle))

    def _verdict(self, published: list[float]) -> None:
        unsure = [v >= _UNSURE for v in published]
        self.ratios = [v - _UNSURE if u else v for v, u in zip(published, unsure, strict=True)]
        kept = max(self.ratios) <= 1 - self.margin and not any(unsure)
        if kept:
            self.phase = WatchPhase.KEPT
        else:
            self._pending, self.phase = "late", WatchPhase.BACK
        self._decide(text.verdict(self, unsure, kept=kept))

    def _decide(self, text: str) -> None:
        self.decisions.append((self.steps, text))
        if self.note is not None:
            self.note(f"input_dist schedule, step {self.steps}: {text}")
