"""`StepWatch`: one rule for a choice the pipeline makes from the job's own steps, shared by the
default input_dist schedule (`pipeline.stages.watch`) and Prefetch's ahead-or-inline choice on CPU
(`pipeline.stages.prefetch_watch`). It starts in the safe mode, reads a clock around what each step
does anyway, and moves to the other mode only where the steps show a steady cost that the other
mode can hide, then keeps it only where the steps after are faster:

1. Watching, in the start mode: each rank publishes the median, over its last `window` observed
   steps, of the share of the step its subclass measures (`_parts`). When the ranks' mean has
   reached `threshold` for `window + 1` figures in a row (two windows that share no step), every
   rank moves to the other mode at its next step.
2. Trying: the first `settle` steps are not timed; over the next `verify` steps each rank
   publishes its median step over its reference: the lower of the medians of the two halves of its
   last `verify` steps before the switch (a slow patch of the machine just before the switch, or
   steps still speeding up, would make any step after it look faster than the plain median). If
   every rank's ratio is at most `1 - margin`, and on every rank at least `sure` of the verified
   steps are shorter than its reference, the new mode is kept; else every rank goes back at the
   next step and the watch ends: no second try in this job.
3. Kept, back or pinned: no clock runs any more.

A step is timed from its start (`step`) to its end (`step_ended`): the time between two
`progress()` calls (a checkpoint save, an outside eval loop, the end of the data) is not a step's.
Each rank's figure rides in its status word on the batch's fused splits all-to-all
(`pipeline.ranks.word`), so every rank reads every rank's figures for the same batch and decides
alike at the same step; the settings are checked alike on every rank once, before the first figure
(`settings`). A decision loaded from a checkpoint takes effect only once every rank's word shows the
same one (`load_state_dict`). A watch with no ranks to agree with decides from its own figure
(`alone`).
"""

from __future__ import annotations

import enum
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any, ClassVar

import torch.distributed as dist

from pipeline.ranks.word import RESTORED, observed

__all__ = ["StepWatch", "WatchPhase"]

UNSURE = 2.0
"""Added to a rank's published ratio where too few of its steps after the switch were shorter than
its reference (a published ratio itself is capped just under 2)."""
_RATIO_CAP = 1.99


class WatchPhase(enum.Enum):
    WATCHING = "watching"
    TRYING = "trying"
    KEPT = "kept"
    BACK = "back"
    PINNED = "pinned"


FINAL = (WatchPhase.KEPT, WatchPhase.BACK, WatchPhase.PINNED)


class StepWatch:
    """The rule (see the module); a subclass names its modes, measures its parts of a step
    (`_parts`) and words its decisions (`_switched_text`, `_verdict_text`, `_pinned_text`).

    Args:
        window: steps per observation of the share (the median is taken over them).
        verify: steps timed in the new mode before the verdict, compared with as many steps before.
        warmup: steps not observed at the start.
        threshold: the ranks' mean share at which the other mode is tried, once it has held for
            `window + 1` figures in a row.
        settle: untimed steps after the switch.
        margin: the gain every rank must see for the new mode to be kept (0.05: 5 % faster).
        sure: and the share of the verified steps shorter than the median step before the switch,
            on every rank (0.75 of 20: 15 steps; by chance alone, once in 50).
        clock: seconds, monotonic (tests inject a fake one).
    """

    modes: ClassVar[tuple[str, str]] = ("start", "other")
    """(the mode it starts in and goes back to, the mode it may try)."""
    label: ClassVar[str] = "watch"
    """What the report's notes name it by."""

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
        """The settings (see Args), read by the words."""
        self.clock = clock
        """Seconds, monotonic: what every time this watch sees is read from."""
        self.partner: Any = None
        """Another choice made from the same steps (the other watch, or the schedule tuner):
        while it verifies (`tuning`), this one does not move."""
        self.mode = self.modes[0]
        """The mode in use."""
        self.phase = WatchPhase.WATCHING
        self.alone = False
        """No ranks to agree with: each figure is decided on as soon as it is published."""
        self._high = 0
        """Consecutive figures (the ranks' mean share) at or above the threshold."""
        self._samples: deque[tuple[float, tuple[float, ...]]] = deque(maxlen=window)
        """(step, parts) seconds of the last `window` observed steps in the start mode."""
        self._recent: deque[float] = deque(maxlen=verify)
        """The last `verify` observed step times in the start mode (what the steps after a switch
        are compared to)."""
        self._before: list[float] = []
        self._after: list[float] = []
        self._skip = 0
        self._last: float | None = None
        """When the step under way began (None: not timed)."""
        self._ended: float | None = None
        """When it ended (`step_ended`)."""
        self._restored: dict[str, Any] | None = None
        """A decision loaded from a checkpoint, until every rank's word shows it (`load_state_dict`)."""
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

    # -- what a subclass provides --------------------------------------------------------------

    def _parts(self) -> tuple[float, ...]:
        """Seconds of the step just ended spent in what the other mode could hide (and reset)."""
        return ()

    def _observing(self) -> bool:
        """Whether steps are observed yet (beyond the warm-up)."""
        return True

    def _switched_text(self, share: float) -> str:
        return f"tried {self.modes[1]} at a share of {share:.0%}"

    def _verdict_text(self, unsure: list[bool], *, kept: bool) -> str:
        return f"kept {self.modes[1]}" if kept else f"back to {self.modes[0]}"

    def _pinned_text(self, reason: str) -> str:
        return f"kept {self.modes[0]}: {reason}"

    # -- what the pipeline calls ---------------------------------------------------------------

    def step(self) -> str:
        """At the start of each training step: the mode to run it in."""
        self.steps += 1
        if self.phase in FINAL:  # the hot path once decided: no clock
            if self._pending is not None:
                self.mode, self._pending, self._published = self._pending, None, 0
            return self.mode
        now = self.clock()
        parts = self._parts()
        ended, self._ended = self._ended, None
        timed = self._last is not None and ended is not None
        if timed and self.steps > self.warmup + 1 and self._observing():
            self._record(ended - self._last, parts)
        self._last = now
        if self._pending is not None:
            self.mode, self._pending = self._pending, None
        self._published = self._observation()
        if self.alone and self._published:
            self.received([self._published])
        return self.mode

    def step_ended(self) -> None:
        """At the end of each step (after the optimizer): what `step` times the step to."""
        if self._last is not None:
            self._ended = self.clock()

    def interrupt(self) -> None:
        """An eval step, or a step that ended abnormally: do not time across it."""
        self._last = self._ended = None
        self._parts()

    def settings(self) -> str:
        """The settings, in one line: the ranks check that theirs are alike before the first figure
        rides (settings that differ would decide differently on the same words)."""
        return (
            f"{type(self).__name__}(window={self.window}, verify={self.verify}, warmup={self.warmup}, "
            f"threshold={self.threshold}, settle={self.settle}, margin={self.margin}, sure={self.sure})"
        )

    @property
    def publishing(self) -> bool:
        """Whether this watch has figures for the ranks to read (it watches or tries, or holds a
        loaded decision, with ranks)."""
        return (self.phase not in FINAL or self._restored is not None) and not self.alone

    def observation(self) -> int:
        """This rank's figure for the batch started now (`pipeline.ranks.word.observed`; 0: none yet)."""
        return self._published

    def received(self, observations: list[int]) -> None:
        """Every rank's figure for one batch (the same list on every rank): decide where they suffice."""
        if self._restored is not None or any(o in RESTORED for o in observations):
            if any(observations):  # all 0: no rank's word spoke for this watch
                self._agree_restored(observations)
            return
        if self._pending is not None or self.phase in FINAL or not observations:
            return
        if 0 in observations:  # some rank has no figure yet
            return
        values = [(o - 1) / 1000 for o in observations]
        if self.phase is WatchPhase.WATCHING:
            if self.partner is not None and self.partner.tuning:
                self._high = 0  # the partner's switch changes the steps: start again after it
                return
            share = statistics.fmean(values)
            self._high = self._high + 1 if share >= self.threshold else 0
            if self._high > self.window:
                self._switch(values, share)
        elif self.phase is WatchPhase.TRYING:
            self._verdict(values)

    def pin(self, reason: str) -> None:
        """Keep the start mode without watching (`reason` says why)."""
        self.mode, self.phase, self._pending = self.modes[0], WatchPhase.PINNED, None
        self._decide(self._pinned_text(reason))

    def no_ride(self, reason: str) -> None:
        """The ranks' figures cannot ride on their words (`reason`): pinned by default (a decided
        watch stays as it is)."""
        if self.phase not in FINAL:
            self.pin(reason)

    # -- what users read -----------------------------------------------------------------------

    @property
    def choice(self) -> str | None:
        """The mode kept, once the watch has ended (None while it watches or tries)."""
        return self.mode if self.phase in FINAL else None

    @property
    def reason(self) -> str | None:
        """The last decision, in words."""
        return self.decisions[-1][1] if self.decisions else None

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
    def tuning(self) -> bool:
        """The other mode runs only to be verified."""
        return self.phase is WatchPhase.TRYING

    @property
    def medians_ms(self) -> dict[str, float]:
        """This rank's median step before and after the switch, in ms (empty before a verdict)."""
        if not (self._before and len(self._after) >= self.verify):
            return {}
        start, other = self.modes
        return {start: 1e3 * self.reference, other: 1e3 * statistics.median(self._after)}

    @property
    def tuning_steps_by_schedule(self) -> dict[str, int]:
        """Steps run in the other mode only to verify it (none where it was kept)."""
        if self.phase is WatchPhase.BACK:
            return {self.modes[1]: self.settle + self.verify + 1}
        return {}

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
    def faster_steps(self) -> float:
        """The share of this rank's verified steps shorter than its median step before the switch;
        0 before the verification window is full."""
        if len(self._after) < self.verify or not self._before:
            return 0.0
        before = self.reference
        return sum(a < before for a in self._after) / len(self._after)

    def state_dict(self) -> dict[str, Any]:
        """The decision and the world size it was taken at, to save with a checkpoint: a job that
        loads it does not try again. While watching or trying, the state says so, and a restarted
        job watches from the start."""
        return {
            "phase": self.phase.value,
            "mode": self.mode,
            "decisions": list(self.decisions),
            "world_size": _world_size(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a saved decision. With ranks to agree with, it waits until every rank's word shows
        the same decision, then takes effect on every rank at the same step; where any rank's word
        differs (a rank loaded another state, or none), every rank drops it and watches afresh.
        Alone (one rank, or a watch whose choice cannot split the ranks), it takes effect at the next
        step. A state saved while watching or trying, at another world size, or (where nothing
        rides, so the ranks cannot agree) for the other mode leaves the watch as it is, and says so.

        Raises:
            ValueError: the state names a mode this watch does not have.
        """
        if not state or WatchPhase(state["phase"]) not in FINAL:
            return
        mode = state.get("mode", state.get("schedule"))
        if mode not in self.modes:
            raise ValueError(f"a saved {type(self).__name__} state names {mode!r}, not one of {self.modes}")
        saved, world = state.get("world_size"), _world_size()
        if saved is not None and saved != world:
            self._decide(f"a decision saved at world size {saved} is not taken at {world}: watching afresh")
        elif self.alone or world == 1:
            self._take(state)
        elif self.phase is WatchPhase.PINNED and mode != self.mode:
            self._decide(f"a saved {mode!r} is not taken: nothing rides, so the ranks cannot agree on it")
        else:
            self._restored = state

    def _take(self, state: dict[str, Any]) -> None:
        mode = state.get("mode", state.get("schedule"))
        self.phase = WatchPhase(state["phase"])
        self._pending = mode if mode != self.mode else None
        self.decisions = [tuple(d) for d in state["decisions"]]

    def _agree_restored(self, observations: list[int]) -> None:
        """A batch's words where some rank holds a loaded decision: taken where every rank's word
        shows the one this rank holds, else dropped (every rank reads the same words, so every rank
        ends alike: all take it, or none does)."""
        if self._restored is None:
            return
        state, self._restored = self._restored, None
        mine = RESTORED[self.modes.index(state.get("mode", state.get("schedule")))]
        if observations and all(o == mine for o in observations):
            self._take(state)
            mode = self.mode if self._pending is None else self._pending
            self._decide(f"took the saved decision ({mode}): every rank holds it")
        else:
            self._decide("dropped the saved decision: not every rank holds it; watching afresh")

    # -- the rule ------------------------------------------------------------------------------

    def _record(self, step_s: float, parts: tuple[float, ...]) -> None:
        if self.phase is WatchPhase.WATCHING:
            self._samples.append((step_s, parts))
            self._recent.append(step_s)
        elif self.phase is WatchPhase.TRYING:
            if self._skip > 0:
                self._skip -= 1
            elif len(self._after) < self.verify:
                self._after.append(step_s)

    def _observation(self) -> int:
        if self._restored is not None:
            return RESTORED[self.modes.index(self._restored.get("mode", self._restored.get("schedule")))]
        if self.phase is WatchPhase.WATCHING:
            return observed(self._share())
        if self.phase is WatchPhase.TRYING and len(self._after) >= self.verify:
            ratio = min(_RATIO_CAP, statistics.median(self._after) / self.reference)
            return observed(ratio if self.faster_steps >= self.sure else ratio + UNSURE)
        return 0

    def _switch(self, shares: list[float], share: float) -> None:
        self.shares = shares
        self._before = list(self._recent)
        self._after, self._pending, self.phase = [], self.modes[1], WatchPhase.TRYING
        # the step that decides runs on in the start mode: its time is not the new mode's
        self._skip = self.settle + 1
        self._decide(self._switched_text(share))

    def _verdict(self, published: list[float]) -> None:
        unsure = [v >= UNSURE for v in published]
        self.ratios = [v - UNSURE if u else v for v, u in zip(published, unsure, strict=True)]
        kept = max(self.ratios) <= 1 - self.margin and not any(unsure)
        if kept:
            self.phase = WatchPhase.KEPT
        else:
            self._pending, self.phase = self.modes[0], WatchPhase.BACK
        self._decide(self._verdict_text(unsure, kept=kept))

    def _decide(self, text: str) -> None:
        self.decisions.append((self.steps, text))
        if self.note is not None:
            self.note(f"{self.label}, step {self.steps}: {text}")


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
