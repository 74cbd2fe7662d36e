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
        """The median of the faster half of the steps before the switch (s; their median where
        there are fewer than 4): what the quick verdict (`verified`) compares each step after with."""
        return statistics.median(_faster_half(self._before))

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
        """The share of (step after, step before) pairs, each side's faster half, in which the step
        after is shorter; 0 before `verified`."""
        if not self.verified:
            return 0.0
        after, before = _faster_half(self._after), _faster_half(self._before)
        return sum(a < b for a in after for b in before) / (len(after) * len(before))

    def ratio(self, sure: float) -> float:
        """This rank's step ratio after/before the switch (once `verified`): the `sure` quantile of
        the ratios of every (step after, step before) pair, each side's faster half. At 0.5 it is
        the median pairwise ratio: at most 1 - margin where more than half the pairs show the gain.
        Both sides are read alike, so a slow patch of the machine on either side is left out the
        same way, and the steps after are not held to a reference biased low."""
        after, before = _faster_half(self._after), _faster_half(self._before)
        return _quantile(sorted(a / b for a in after for b in before), sure)

    def _medians_ms(self, modes: tuple[str, str]) -> dict[str, float]:
        """This rank's median step before and after the switch, in ms, by mode, each side's faster
        half (empty before `verified`)."""
        if not self.verified:
            return {}
        return {modes[0]: 1e3 * self.reference, modes[1]: 1e3 * statistics.median(_faster_half(self._after))}


def _faster_half(steps: list[float]) -> list[float]:
    """The half of `steps` (first or second) whose median is lower; all of them under 4."""
    if len(steps) < 4:
        return steps
    half = len(steps) // 2
    first, second = steps[:half], steps[half:]
    return first if statistics.median(first) <= statistics.median(second) else second


def _quantile(ordered: list[float], q: float) -> float:
    """The `q` quantile of `ordered` (sorted), interpolated between neighbours."""
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
