"""`StepWatch`: one rule for a choice the pipeline makes from the job's own steps, shared by the
default input_dist schedule (`pipeline.stages.watch`) and Prefetch's ahead-or-inline choice on CPU
(`pipeline.stages.prefetch_watch`); docs/reference.md, "The default schedule", says it in full.

1. Watching, in the start mode: each rank publishes the median share of its last `window` steps
   that the other mode could hide (`_parts`); once the ranks' mean has reached `threshold` for
   `window + 1` figures in a row (or for one, where every rank's is twice `threshold`), every rank
   moves to the other mode at its next step.
2. Trying: after `settle` untimed steps, each rank times `verify` steps (half as many where they
   are clear: `StepTimes.verified`) and publishes its step ratio: the median ratio of every pair
   of a step after and a step before the switch, the faster half of each side (`StepTimes.ratio`).
   The ranks step in lockstep, so they measure one job's step: kept where the ranks' mean ratio
   is at most `1 - margin` and no rank's is `1 + margin` or more; else every rank goes back, once.
3. Kept, back or pinned: no clock runs any more.

A step is timed from `step` to `step_ended`: the time between two `progress()` calls is not a
step's. The figures ride in the ranks' status words (`pipeline.ranks.rows`), so every rank decides
from the same figures at the same step; the settings are agreed once (`settings`), and a decision
loaded from a checkpoint takes effect only once every rank's word shows it (`load_state_dict`). A
watch with no ranks to agree with decides from its own figure (`alone`).
"""

from __future__ import annotations

import enum
import statistics
import time
from collections.abc import Callable
from typing import Any, ClassVar

from pipeline.ranks.rows import RESTORED, observed
from pipeline.stages.saved_decision import SavedDecision, world_size
from pipeline.stages.step_times import StepTimes

__all__ = ["StepWatch", "WatchPhase"]


class WatchPhase(enum.Enum):
    WATCHING = "watching"
    TRYING = "trying"
    KEPT = "kept"
    BACK = "back"
    PINNED = "pinned"


FINAL = (WatchPhase.KEPT, WatchPhase.BACK, WatchPhase.PINNED)


class StepWatch(StepTimes):
    """The rule (see the module); a subclass names its modes, measures its parts of a step
    (`_parts`) and words its decisions (`_switched_text`, `_verdict_text`, `_pinned_text`).

    Args:
        window: steps per observation of the share (the median is taken over them).
        verify: steps timed in the new mode before the verdict, compared with as many steps before.
        warmup: steps not observed at the start.
        threshold: the ranks' mean share at which the other mode is tried, once it has held for
            `window + 1` figures in a row.
        settle: untimed steps after the switch.
        margin: the gain the job must see for the new mode to be kept (0.05: the ranks' mean step
            ratio at most 0.95); a rank slower by as much vetoes it.
        sure: the quantile of its pairwise step ratios a rank publishes (0.5: the median; 0.75: a
            gain shown by three pairs in four).
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
        sure: float = 0.5,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if min(window, verify) < 3 or min(warmup, settle) < 0 or not (0 < threshold < 1 and 0 <= margin < 1):
            raise ValueError(f"bad watch settings: window {window}, threshold {threshold}, margin {margin}")
        if not 0 <= sure <= 1:
            raise ValueError(f"bad watch settings: sure {sure}")
        super().__init__(window=window, verify=verify, margin=margin, clock=clock)
        self.threshold, self.settle = threshold, settle
        self.warmup, self.sure = warmup, sure
        """The settings (see Args), read by the words."""
        self.partner: Any = None
        """The other watch of the same steps: while it verifies (`tuning`), this one does not move."""
        self.mode = self.modes[0]  # the mode in use
        self.phase, self.alone = WatchPhase.WATCHING, False
        """No ranks to agree with: each figure is decided on as soon as it is published."""
        self._high = 0
        """Consecutive figures (the ranks' mean share) at or above the threshold."""
        self._restored: SavedDecision | None = None
        """A decision loaded from a checkpoint, until every rank's word shows it (`load_state_dict`)."""
        self._pending: str | None = None
        self._published = self.steps = 0
        """Training steps begun (`step` calls, and the pipeline's count while `settled`)."""
        self.settled = False
        """Decided and applied: `step` would only count the step, so until `load_state_dict` the
        pipeline counts it and calls none of `step`, `step_ended`, `interrupt`."""
        self.decisions: list[tuple[int, str]] = []
        """(step, what was seen and done), in order."""
        self.shares: list[float] = []
        """The ranks' published shares at the switch, empty before it."""
        self.ratios: list[float] = []
        """The ranks' step ratios after/before the switch, at the verdict."""
        self.note: Callable[[str], None] | None = None
        """Told each decision's sentence (the rewrite report's notes)."""

    # -- what a subclass provides: its parts of a step (seconds the other mode could hide since
    # the last call; reset), whether steps are observed yet, and (not here) the words of its
    # decisions: `_switched_text(share, clear)`, `_verdict_text(kept=)`, `_pinned_text(reason)`

    def _parts(self) -> tuple[float, ...]:
        return ()

    def _observing(self) -> bool:
        return True

    # -- what the pipeline calls ---------------------------------------------------------------

    def step(self) -> str:
        """At the start of each training step: the mode to run it in."""
        self.steps += 1
        if self.phase in FINAL:  # once decided: no clock (`_forget_step` stopped it)
            if self._pending is not None:
                self.mode, self._pending, self._published = self._pending, None, 0
            self.settled = self._restored is None
            return self.mode
        step_s, parts = self._timed(), self._parts()
        if step_s is not None and self.steps > self.warmup + 1 and self._observing():
            self._record(step_s, parts, watching=self.phase is WatchPhase.WATCHING)
        if self._pending is not None:
            self.mode, self._pending = self._pending, None
        self._published = self._observation()
        if self.alone and self._published:
            self.received([self._published])
        return self.mode

    def interrupt(self) -> None:
        """An eval step, or a step that ended abnormally: do not time across it."""
        self._forget_step()
        self._parts()

    def settings(self) -> str:
        """The settings, in one line, which the ranks check are alike before the first figure rides."""
        names = ("window", "verify", "warmup", "threshold", "settle", "margin", "sure")
        return f"{type(self).__name__}(" + ", ".join(f"{n}={getattr(self, n)}" for n in names) + ")"

    @property
    def publishing(self) -> bool:
        """It has figures for the ranks to read (it watches, tries, or holds a loaded decision)."""
        return (self.phase not in FINAL or self._restored is not None) and not self.alone

    def observation(self) -> int:
        """This rank's figure for the batch started now (`pipeline.ranks.rows.observed`; 0: none yet)."""
        return self._published

    def received(self, observations: list[int]) -> None:
        """Every rank's figure for one batch (the same list on every rank): decide where they suffice."""
        if self._restored is not None or any(o in RESTORED for o in observations):
            if any(observations):  # all 0: no rank's word spoke for this watch
                self._agree_restored(observations)
        elif self._pending is None and self.phase not in FINAL and observations and 0 not in observations:
            self._decide_on([(o - 1) / 1000 for o in observations])  # 0: some rank has no figure yet

    def _decide_on(self, values: list[float]) -> None:
        if self.phase is WatchPhase.WATCHING:
            if self.partner is not None and self.partner.tuning:
                self._high = 0  # the partner's switch changes the steps: start again after it
                return
            share = statistics.fmean(values)
            self._high = self._high + 1 if share >= self.threshold else 0
            if self._high > self.window or (self._high and min(values) >= 2 * self.threshold):
                self._switch(values, share)
        elif self.phase is WatchPhase.TRYING:
            self._verdict(values)

    def pin(self, reason: str) -> None:
        """Keep the start mode without watching (`reason` says why)."""
        self.mode, self.phase, self._pending = self.modes[0], WatchPhase.PINNED, None
        self._forget_step()
        self._decide(self._pinned_text(reason))

    def no_ride(self, reason: str) -> None:
        """The ranks' figures cannot ride (`reason`): pinned, unless decided already."""
        if self.phase not in FINAL:
            self.pin(reason)

    # -- what users read -----------------------------------------------------------------------

    @property
    def choice(self) -> str | None:
        """The mode kept once the watch has ended (None while it watches or tries)."""
        return self.mode if self.phase in FINAL else None

    @property
    def reason(self) -> str | None:
        """The last decision, in words."""
        return self.decisions[-1][1] if self.decisions else None

    @property
    def tuning(self) -> bool:
        """The other mode runs only to be verified."""
        return self.phase is WatchPhase.TRYING

    @property
    def medians_ms(self) -> dict[str, float]:
        """This rank's median step before and after the switch, in ms (empty before a verdict)."""
        return self._medians_ms(self.modes)

    @property
    def tuning_steps_by_schedule(self) -> dict[str, int]:
        """Steps run in the other mode only to verify it (none where it was kept)."""
        return {self.modes[1]: self.settle + len(self._after) + 1} if self.phase is WatchPhase.BACK else {}

    def state_dict(self) -> dict[str, Any]:
        """The decision and the world size it was taken at, to save with a checkpoint: a job that
        loads it does not try again (a state saved while watching or trying: it watches afresh)."""
        return {"phase": self.phase.value, "mode": self.mode, "decisions": list(self.decisions),
                "world_size": world_size()}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a saved decision: with ranks, once every rank's word shows it (where any differs,
        every rank drops it and watches afresh); alone, at the next step. A state saved while
        watching, at another world size, or for the other mode where nothing rides leaves the watch
        as it is (`SavedDecision.refused` says why).

        Raises:
            ValueError: the state names a mode this watch does not have.
        """
        saved = SavedDecision.parse(state, self.modes, tuple(p.value for p in FINAL))
        pinned = self.mode if self.phase is WatchPhase.PINNED else None
        self.settled = False
        if saved is None:
            return
        if (why := saved.refused(world_size(), pinned_to=pinned)) is not None:
            self._decide(why)
        elif self.alone or world_size() == 1:
            self._take(saved)
        else:
            self._restored = saved

    def _take(self, saved: SavedDecision) -> None:
        self.phase = WatchPhase(saved.phase)
        self._pending = saved.mode if saved.mode != self.mode else None
        self.decisions = list(saved.decisions)
        self._forget_step()

    def _agree_restored(self, observations: list[int]) -> None:
        """Taken where every rank's word shows this rank's loaded decision (so by all), else dropped."""
        saved, self._restored = self._restored, None
        if saved is not None and saved.held_by_all(observations):
            self._take(saved)
            self._decide(f"took the saved decision ({saved.mode}): every rank holds it")
        elif saved is not None:
            self._decide("dropped the saved decision: not every rank holds it; watching afresh")

    # -- the rule ------------------------------------------------------------------------------

    def _observation(self) -> int:
        if self._restored is not None:
            return self._restored.code
        if self.phase is WatchPhase.WATCHING:
            return observed(self._share())
        if self.phase is WatchPhase.TRYING and self.verified:
            return observed(self.ratio(self.sure))
        return 0

    def _switch(self, shares: list[float], share: float) -> None:
        self.shares = shares
        self._pending, self.phase = self.modes[1], WatchPhase.TRYING
        # the step that decides runs on in the start mode: its time is not the new mode's
        self._start_verifying(self.settle + 1)
        self._decide(self._switched_text(share, self._high <= self.window))  # before a full run: clear

    def _verdict(self, ratios: list[float]) -> None:
        # The ranks step in lockstep, so each rank's ratio measures the same job's step through its
        # own clock: their mean is the job's, and a rank whose window was noisy does not undo a
        # gain the others saw. A rank clearly slower after the switch (by `margin`) vetoes it.
        self.ratios = ratios
        kept = statistics.fmean(ratios) <= 1 - self.margin and max(ratios) < 1 + self.margin
        if kept:
            self.phase = WatchPhase.KEPT
        else:
            self._pending, self.phase = self.modes[0], WatchPhase.BACK
        self._forget_step()  # decided: this step's end reads no clock either
        self._decide(self._verdict_text(kept=kept))

    def _decide(self, text: str) -> None:
        self.decisions.append((self.steps, text))
        if self.note is not None:
            self.note(f"{self.label}, step {self.steps}: {text}")
