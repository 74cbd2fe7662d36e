"""`StepTimes`: what a watch (`pipeline.stages.step_watch.StepWatch`) has seen of the job's steps,
and the figures it decides on: each step timed from its start to its end (`step_ended`: the time
between two `progress()` calls is not a step's), the share of a step that the other mode could hide
over a window of steps, and the steps after a switch against the steps before it. No rule lives
here; the watch records into it and reads from it."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable

__all__ = ["QUICK", "StepTimes"]

QUICK = 10
"""The fewest verified steps a clear verdict is taken on (`StepTimes.verified`)."""


class StepTimes:
    """The steps observed in the start mode and the steps verified after a switch.

    Args:
        window: steps per observation of the share (the median is taken over them).
        verify: steps timed in the new mode before the verdict, compared with as many steps before
            (half as many where those are clear: `verified`).
        margin: the gain that makes the steps after clearly faster (0.05: 5 %).
        clock: seconds, monotonic (tests inject a fake one).
    """

    def __init__(self, *, window: int, verify: int, margin: float, clock: Callable[[], float]) -> None:
        self.window, self.verify, self.margin = window, verify, margin
        self.clock = clock
        """Seconds, monotonic: what every time this watch sees is read from."""
        self._last: float | None = None
        """When the step under way began (None: not timed)."""
        self._ended: float | None = None
        """When it ended (`step_ended`)."""
        self._skip = 0
        """Steps after a switch not to time yet."""
        self._samples: deque[tuple[float, tuple[float, ...]]] = deque(maxlen=window)
        """(step, parts) seconds of the last `window` observed steps in the start mode."""
        self._recent: deque[float] = deque(maxlen=verify)
        """The last `verify` observed step times in the start mode (what the steps after a switch
        are compared to)."""
        self._before: list[float] = []
        """`_recent` as it was at the switch."""
        self._after: list[float] = []
        """The verified step times after the switch."""

    def step_ended(self) -> None:
        """At the end of each step (after the optimizer): what the step is timed to."""
        if self._last is not None:
            self._ended = self.clock()

    def _forget_step(self) -> None:
        self._last = self._ended = None

    def _timed(self) -> float | None:
        """At a step's start: the time of the step before it (None where it was not timed)."""
        now, ended, self._ended = self.clock(), self._ended, None
        step_s = ended - self._last if self._last is not None and ended is not None else None
        self._last = now
        return step_s

    def _record(self, step_s: float, parts: tuple[float, ...], *, watching: bool) -> None:
        """One observed step: in the start mode (`watching`), else after the switch."""
        if watching:
            self._samples.append((step_s, parts))
            self._recent.append(step_s)
        elif self._skip > 0:
            self._skip -= 1
        elif len(self._after) < self.verify:
            self._after.append(step_s)

    def _start_verifying(self, skip: int) -> None:
        """At the switch: the steps before it are kept; the first `skip` after it are not timed."""
        self._before, self._after, self._skip = list(self._recent), [], skip

    @property
    def share(self) -> float | None:
        """This rank's median share over the last `window` observed steps in the start mode (None
        before a full window)."""
        return self._share()

    def _share(self) -> float | None:
        if len(self._samples) < self.window:
            return None
        return statistics.median(sum(p) / s if s > 0 else 0.0 for s, p in self._samples)

    def median_part(self, i: int) -> float:
        """Of `share`, the median share of part `i` over the same window (0 before a full window)."""
        if len(self._samples) < self.window:
            return 0.0
        return statistics.median(p[i] / s if s > 0 else 0.0 for s, p in self._samples)

    @property
    def reference(self) -> float:
        """What the steps after the switch are compared with (s): the lower of the medians of the
        two halves of the steps before it (their median where there are fewer than 4)."""
        before = self._before
        if len(before) < 4:
            return statistics.median(before)
        half = len(before) // 2
        return min(statistics.median(before[:half]), statistics.median(before[half:]))

    @property
    def verified(self) -> bool:
        """The verification window after the switch is full, or its first half is clear and holds
        `QUICK` steps or more: every step of it shorter than `reference` by `margin` or more, or none
        shorter than `reference` (by chance alone, either once in 2^10 or less)."""
        after = self._after
        if not self._before or len(after) < min(self.verify, max(QUICK, self.verify // 2)):
            return False
        if len(after) >= self.verify:
            return True
        reference = self.reference
        return all(a < reference * (1 - self.margin) for a in after) or all(a >= reference for a in after)

    @property
    def faster_steps(self) -> float:
        """The share of this rank's verified steps shorter than its median step before the switch;
        0 before the verification window is full."""
        if not self.verified:
            return 0.0
        before = self.reference
        return sum(a < before for a in self._after) / len(self._after)

    def ratio(self) -> float:
        """This rank's median verified step over `reference` (once `verified`)."""
        return statistics.median(self._after) / self.reference

    def _medians_ms(self, modes: tuple[str, str]) -> dict[str, float]:
        """This rank's median step before and after the switch, in ms, by mode (empty before the
        verification window is full)."""
        if not self.verified:
            return {}
        return {modes[0]: 1e3 * self.reference, modes[1]: 1e3 * statistics.median(self._after)}
