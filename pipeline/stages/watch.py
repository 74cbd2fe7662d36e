"""`StepWatch`, the rule by which every rank moves at once between two modes from what the steps show
(docs/reference.md, "The default schedule"; `ScheduleWatch` and `PrefetchWatch` follow it); also
`StepTimes` (the steps seen), `WaitClock` (the time blocked in a step) and `SavedDecision`."""

from __future__ import annotations

import enum
import inspect
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from pipeline.ranks.failure import rank_and_world
from pipeline.ranks.riding import RESTORED, observed

__all__ = ["QUICK", "SavedDecision", "StepTimes", "StepWatch", "WaitClock", "WatchPhase", "world_size"]


# -- the steps seen ----------------------------------------------------------------------------------


QUICK = 10
"""The fewest verified steps a clear verdict is taken on (`StepTimes.verified`)."""


class StepTimes:
    """The steps observed in the start mode and the steps verified after a switch (Args: `StepWatch`'s)."""

    def __init__(self, *, window: int, verify: int, margin: float, clock: Callable[[], float]) -> None:
        self.window, self.verify, self.margin = window, verify, margin
        self.clock = clock
        self._last: float | None = None
        """When the step under way began (None: not timed)."""
        self._ended: float | None = None
        self._skip = 0
        """Steps after a switch not to time yet."""
        self._samples: deque[tuple[float, tuple[float, ...]]] = deque(maxlen=window)
        """(step, parts) seconds of the last `window` observed steps in the start mode."""
        self._shares: deque[float] = deque(maxlen=window)
        """The share of each of them that the parts took."""
        self._recent: deque[float] = deque(maxlen=verify)
        """The last `verify` observed step times, which the steps after a switch are compared to."""
        self._before: list[float] = []
        """`_recent` as it was at the switch."""
        self._after: list[float] = []
        """The verified step times after the switch."""

    def step_ended(self) -> None:
        """Call at the end of each step, after the optimizer: the time to the next `step` is not a step's."""
        if self._last is not None:
            self._ended = self.clock()

    def _forget_step(self) -> None:
        self._last = self._ended = None

    @property
    def share(self) -> float | None:
        """This rank's median share over the last `window` observed steps (None before a full window)."""
        return self._share()

    def _share(self) -> float | None:
        if len(self._samples) < self.window:
            return None
        return statistics.median(self._shares)

    def median_part(self, i: int) -> float:
        """Of `share`, the median share of part `i` over the same window (0 before a full window)."""
        if len(self._samples) < self.window:
            return 0.0
        return statistics.median(p[i] / s if s > 0 else 0.0 for s, p in self._samples)

    @property
    def reference(self) -> float:
        """The median of the faster half of the steps before the switch (s), for `verified`."""
        return statistics.median(_faster_half(self._before))

    @property
    def verified(self) -> bool:
        """The window after the switch is full, or its first half (`QUICK` steps or more) is clear."""
        after = self._after
        if not self._before or len(after) < min(self.verify, max(QUICK, self.verify // 2)):
            return False
        if len(after) >= self.verify:
            return True
        reference = self.reference
        return all(a < reference * (1 - self.margin) for a in after) or all(a >= reference for a in after)

    @property
    def faster_steps(self) -> float:
        """The share of (after, before) step pairs whose step after is shorter (0 before `verified`)."""
        if not self.verified:
            return 0.0
        after, before = _faster_half(self._after), _faster_half(self._before)
        return sum(a < b for a in after for b in before) / (len(after) * len(before))

    def ratio(self, sure: float) -> float:
        """This rank's step ratio after/before the switch: the `sure` quantile over (after, before) pairs."""
        after, before = _faster_half(self._after), _faster_half(self._before)
        return _quantile(sorted(a / b for a in after for b in before), sure)


def _faster_half(steps: list[float]) -> list[float]:
    """The half of `steps` (first or second) whose median is lower; all of them under 4."""
    if len(steps) < 4:
        return steps
    half = len(steps) // 2
    first, second = steps[:half], steps[half:]
    return first if statistics.median(first) <= statistics.median(second) else second


def _quantile(ordered: list[float], q: float) -> float:
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


# -- the time blocked in a step ----------------------------------------------------------------------


class WaitClock:
    """Adds up how long `thread` blocks in a step: the input all-to-alls' waits (`waited`: `timed`, and
    in place in `InputDist.wait_splits`) and backward's wall time less its CPU time (`idle`: in place in
    `PipelineCore._backward_stage`); other threads' waits are not the step's."""

    __slots__ = ("cpu", "idle", "now", "thread", "waited")

    def __init__(self, clock: Callable[[], float], cpu: Callable[[], float] = time.thread_time) -> None:
        self.now, self.cpu = clock, cpu
        self.waited = 0.0
        """Seconds blocked in the input all-to-alls' waits."""
        self.idle = 0.0
        """Seconds off the CPU within backward."""
        self.thread: int | None = None

    def timed(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)`, its wall time added to `waited` where it runs on the pipeline's thread."""
        if threading.get_ident() != self.thread:
            return fn(*args)
        start = self.now()
        try:
            return fn(*args)
        finally:
            self.waited += self.now() - start


# -- a decision saved with a checkpoint --------------------------------------------------------------


def world_size() -> int:
    """The job's world size (1 without a process group)."""
    return rank_and_world()[1]


@dataclass(frozen=True, slots=True)
class SavedDecision:
    """One final decision of a watch whose modes are `modes`."""

    phase: str
    """"kept", "back" or "pinned" (`WatchPhase`'s values)."""
    mode: str
    decisions: tuple[tuple[int, str], ...]
    world_size: int | None
    """The world size it was taken at (None: a state saved before it was recorded)."""
    code: int
    """The figure a watch holding it publishes (`pipeline.ranks.riding.RESTORED`, by mode)."""

    @classmethod
    def parse(
        cls, state: dict[str, Any], modes: tuple[str, str], final: tuple[str, ...]
    ) -> SavedDecision | None:
        """The decision in `state` (a `state_dict()`); None where empty or saved in a phase not in `final`.

        Raises:
            ValueError: the state names a mode that is not one of `modes`.
        """
        if not state or state["phase"] not in final:
            return None
        mode = state.get("mode", state.get("schedule"))
        if mode not in modes:
            raise ValueError(f"a saved watch state names {mode!r}, not one of {modes}")
        decisions = tuple(tuple(d) for d in state["decisions"])
        return cls(state["phase"], mode, decisions, state.get("world_size"), RESTORED[modes.index(mode)])

    def refused(self, world: int, *, pinned_to: str | None) -> str | None:
        """Why a watch of a `world`-rank job (`pinned_to` a mode where nothing rides) does not take it."""
        if self.world_size is not None and self.world_size != world:
            return f"a decision saved at world size {self.world_size} is not taken at {world}: watching again"
        if pinned_to is not None and self.mode != pinned_to and world > 1:
            return f"a saved {self.mode!r} is not taken: nothing rides, so the ranks cannot agree on it"
        return None

    def held_by_all(self, observations: torch.Tensor) -> bool:
        """Every rank's status for the batch shows this decision."""
        return len(observations) > 0 and bool((observations == self.code).all())


# -- the rule ----------------------------------------------------------------------------------------


class WatchPhase(enum.Enum):
    WATCHING = "watching"
    TRYING = "trying"
    KEPT = "kept"
    BACK = "back"
    PINNED = "pinned"


FINAL = (WatchPhase.KEPT, WatchPhase.BACK, WatchPhase.PINNED)


class StepWatch(StepTimes):
    """The rule of the module. A subclass names its `modes`, measures its parts of a step (`_parts`)
    and words its decisions (`_switched_text(share, clear)`, `_verdict_head(kept=)`, `_pinned_text`).

    Args:
        window: steps per observation of the share (the median is taken over them).
        verify: steps timed in the new mode before the verdict, compared with as many before.
        warmup: steps not observed at the start.
        threshold: the ranks' mean share that, held `window + 1` figures in a row, starts a trial.
        settle: untimed steps after the switch.
        margin: kept at a mean step ratio of at most `1 - margin`; a rank at `1 + margin` vetoes.
        sure: the quantile of its pairwise step ratios a rank publishes (0.5: the median).
        patience: figures in a row under `threshold` that end the watch in the start mode (0: never).
        retries: further trials after an unsure verdict (not kept, no rank `1 + margin` or more).
        backoff: steps after an unsure verdict before the next trial (doubled after each).
        clock: seconds, monotonic (tests inject a fake one).

    Raises:
        ValueError: a setting is out of range.
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
        patience: int = 256,
        retries: int = 2,
        backoff: int = 32,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        # checked before `StepTimes` sizes its windows (a negative one would fail there, unexplained)
        if min(window, verify) < 3 or min(warmup, settle) < 0 or not (0 < threshold < 1 and 0 <= margin < 1):
            raise ValueError(
                f"bad watch settings: window {window}, verify {verify}, warmup {warmup}, settle {settle}, "
                f"threshold {threshold}, margin {margin}"
            )
        if not 0 <= sure <= 1 or min(patience, retries, backoff) < 0:
            raise ValueError(
                f"bad watch settings: sure {sure}, patience {patience}, retries {retries}, backoff {backoff}"
            )
        super().__init__(window=window, verify=verify, margin=margin, clock=clock)
        self.threshold, self.settle = threshold, settle
        self.warmup, self.sure, self.patience = warmup, sure, patience
        self.retries, self.backoff = retries, backoff
        self.partner: Any = None
        """The other watch of the same steps: while it verifies (`tuning`), this one does not move."""
        self.mode = self.modes[0]
        self.phase, self.alone = WatchPhase.WATCHING, False
        """No ranks to agree with: each figure is decided on as soon as it is published."""
        self._high = self._low = 0
        """Consecutive figures (the ranks' mean share) at or above the threshold; below it."""
        self.tries = 0
        """Trials of the other mode begun."""
        self._not_before = 0
        """The step before which no trial begins (`backoff` after an unsure verdict)."""
        self._tuned = 0
        self._restored: SavedDecision | None = None
        """A decision loaded from a checkpoint, until every rank's word shows it (`load_state_dict`)."""
        self._pending: str | None = None
        self._published = self.steps = 0
        """Training steps begun (`step` calls, and the pipeline's count while `settled`)."""
        self.settled = False
        """Decided and applied: until `load_state_dict` the pipeline counts the steps itself and calls
        none of `step`, `step_ended`, `interrupt`."""
        self.decisions: list[tuple[int, str]] = []
        """(step, what was seen and done), in order."""
        self.shares: list[float] = []
        """The ranks' published shares at the switch, empty before it."""
        self.ratios: list[float] = []
        """The ranks' step ratios after/before the switch, at the verdict."""
        self.note: Callable[[str], None] | None = None
        """Told each decision's sentence (the rewrite report's notes)."""
        self.ready: Callable[[], bool] | None = None
        """Whether the steps are steady yet (Prefetch: the caches are full); None: after `warmup`."""
        self.ready_at: int | None = None
        """The step from which steps are observed (`ready` first said so)."""

    def _parts(self) -> tuple[float, ...]:
        """Seconds of each part the other mode could hide since the last call (then reset)."""
        return ()

    # -- what the pipeline calls ---------------------------------------------------------------

    def step(self) -> str:
        """Call at the start of each training step; returns the mode to run it in."""
        self.steps += 1
        if self.phase in FINAL:  # decided: no clock runs
            if self._pending is not None:
                self.mode, self._pending, self._published = self._pending, None, 0
            self.settled = self._restored is None
            return self.mode
        now, last, ended, self._ended = self.clock(), self._last, self._ended, None
        self._last, parts = now, self._parts()
        timed = last is not None and ended is not None and self.steps > self.warmup + 1
        if timed and self.ready_at is None and (self.ready is None or self.ready()):
            self.ready_at = self.steps
        if timed and self.ready_at is not None:
            step_s = ended - last
            if self.phase is WatchPhase.WATCHING:
                self._samples.append((step_s, parts))
                self._shares.append(sum(parts) / step_s if step_s > 0 else 0.0)
                self._recent.append(step_s)
            elif self._skip > 0:
                self._skip -= 1
            elif len(self._after) < self.verify:
                self._after.append(step_s)
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
        names = [n for n in inspect.signature(StepWatch.__init__).parameters if n not in ("self", "clock")]
        return f"{type(self).__name__}(" + ", ".join(f"{n}={getattr(self, n)}" for n in names) + ")"

    @property
    def publishing(self) -> bool:
        """It has figures for the ranks to read (it watches, tries, or holds a loaded decision)."""
        return (self.phase not in FINAL or self._restored is not None) and not self.alone

    def observation(self) -> int:
        """This rank's figure for the batch started now (`pipeline.ranks.riding.observed`; 0: none yet)."""
        return self._published

    def received(self, observations: torch.Tensor | list[int]) -> None:
        """Decide from every rank's figure for one batch, given alike on every rank, so all decide alike."""
        observations = torch.as_tensor(observations, dtype=torch.int64)
        ranks = observations.numel()  # not len(): a tensor's __len__ is a Python call
        if not ranks:
            return
        low, high = torch.aminmax(observations)
        low, high = int(low), int(high)
        if self._restored is not None or high >= RESTORED[0]:
            if high:  # all 0: no rank's status spoke for this watch
                self._agree_restored(observations)
            return
        if self._pending is not None or self.phase in FINAL or not low:  # low 0: a rank has no figure yet
            return
        if self.phase is WatchPhase.TRYING:
            self._verdict([(v - 1) / 1000 for v in observations.tolist()])
            return
        if self.partner is not None and self.partner.tuning:
            self._high = self._low = 0  # the partner's switch changes the steps: start again after it
            return
        share = (int(observations.sum()) / ranks - 1) / 1000
        self._high, self._low = (self._high + 1, 0) if share >= self.threshold else (0, self._low + 1)
        steady = self._high > self.window or (self._high and (low - 1) / 1000 >= 2 * self.threshold)
        if steady and self.steps >= self._not_before:
            self._switch([(v - 1) / 1000 for v in observations.tolist()], share)
        elif self.patience and self._low >= self.patience:
            self.pin(
                f"the ranks' mean share stayed under {self.threshold:.0%} for {self.patience} figures "
                "in a row: nothing to hide, so the watch ends (its clocks stop)"
            )

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
        if not self.verified:
            return {}
        after = statistics.median(_faster_half(self._after))
        return {self.modes[0]: 1e3 * self.reference, self.modes[1]: 1e3 * after}

    @property
    def tuning_steps_by_schedule(self) -> dict[str, int]:
        """Steps run in the other mode by trials that went back (none where the only trial was kept)."""
        return {self.modes[1]: self._tuned} if self._tuned else {}

    def state_dict(self) -> dict[str, Any]:
        """The decision and the world size it was taken at, to save with a checkpoint."""
        return {
            "phase": self.phase.value,
            "mode": self.mode,
            "decisions": list(self.decisions),
            "world_size": world_size(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a saved decision: with ranks, once every rank's word shows it (else all watch afresh);
        alone, at the next step; a state that `SavedDecision.parse` or `refused` rejects changes nothing.

        Raises:
            ValueError: the state names a mode this watch does not have.
        """
        saved = SavedDecision.parse(state, self.modes, tuple(p.value for p in FINAL))
        self.settled = False
        if saved is None:
            return
        pinned = self.mode if self.phase is WatchPhase.PINNED else None
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

    def _agree_restored(self, observations: torch.Tensor) -> None:
        saved, self._restored = self._restored, None
        if saved is not None and saved.held_by_all(observations):
            self._take(saved)
            self._decide(f"took the saved decision ({saved.mode}): every rank holds it")
        elif saved is not None:
            self._decide("dropped the saved decision: not every rank holds it; watching afresh")

    # -- its words ---------------------------------------------------------------------------

    def _shares_text(self) -> str:
        return ", ".join(f"{v:.0%}" for v in self.shares)

    def _verdict_text(self, *, kept: bool) -> str:
        """The verdict: the subclass's `_verdict_head` (what runs now, which steps it compared), the ratios
        and the rule they were held to."""
        mean = sum(self.ratios) / len(self.ratios)
        rule = (
            f"the ranks' mean at most {1 - self.margin:.2f} and none {1 + self.margin:.2f} or more; a "
            "rank's ratio is the median over every pair of a step after and a step before, the faster "
            f"half of each side; this rank's step after was shorter in {self.faster_steps:.0%} of the pairs"
        )
        shown = f"{mean:.2f} (ranks: {', '.join(f'{r:.2f}' for r in self.ratios)})"
        head = self._verdict_head(kept=kept)
        return f"{head} was {shown} ({rule})" if kept else f"{head} was {shown} (kept needs {rule})"

    def _held_text(self, clear: bool) -> str:
        """How the share held before the switch (`clear`: every rank's twice the threshold at once)."""
        if clear:
            return f"at least {2 * self.threshold:.0%} on every rank: clear at the first figure"
        return f"at least {self.threshold:.0%} for {self.window + 1} figures in a row"

    def _verified_text(self) -> str:
        return f"{self.settle} + {self.verify} steps (half as many where the steps after are clear)"

    def _described(self, head: str, watched: str, unit: str, trying: str) -> str:
        """`print(watch)`: what it watches and when it tries the other mode, then each decision."""
        if self.phase is WatchPhase.WATCHING:
            seen = self.share
            seen_text = (
                f"not yet a full window: the first {self.warmup} steps are not observed"
                if seen is None
                else f"{seen:.0%} of the step on this rank"
            )
            ends = f"; ends after {self.patience} {unit} in a row under it" if self.patience else ""
            head = (
                f"{head}; watching how long {watched} over the last {self.window} steps ({seen_text}; "
                f"tries {self.modes[1]} once the ranks' mean has been at least {self.threshold:.0%} for "
                f"{self.window + 1} {unit} in a row{ends})"
            )
        lines = [head] + [f"  step {step}: {line}" for step, line in self.decisions]
        if self.phase is WatchPhase.TRYING:
            lines.append(f"  verifying over {self._verified_text()} {trying}")
        return "\n".join(lines)

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
        self.shares, self.tries = shares, self.tries + 1
        self._pending, self.phase = self.modes[1], WatchPhase.TRYING
        # the steps before are kept; the step that decides runs on in the start mode: its time is not
        # the new mode's, nor are the `settle` steps after it
        self._before, self._after, self._skip = list(self._recent), [], self.settle + 1
        self._decide(self._switched_text(share, self._high <= self.window))  # before a full run: clear

    def _verdict(self, ratios: list[float]) -> None:
        # the ranks step in lockstep: their mean ratio is the job's, and one noisy rank undoes no gain
        self.ratios = ratios
        slower = max(ratios) >= 1 + self.margin
        kept = statistics.fmean(ratios) <= 1 - self.margin and not slower
        again = not (kept or slower) and self.tries <= self.retries
        if kept:
            self.phase = WatchPhase.KEPT
        else:
            self._tuned += self.settle + len(self._after) + 1
            self._pending, self.phase = self.modes[0], WatchPhase.WATCHING if again else WatchPhase.BACK
        self._forget_step()  # decided: this step's end reads no clock either
        text = self._verdict_text(kept=kept)
        if again:  # watch afresh: the figures from before this trial are not the steps to come
            self._not_before = self.steps + self.backoff * 2 ** (self.tries - 1)
            for seen in (self._samples, self._shares, self._recent):
                seen.clear()
            self._high = self._low = 0
            text += (
                f"; unsure (no rank's {1 + self.margin:.2f} or more), so it watches again and may try "
                f"{self.modes[1]} once more from step {self._not_before} (try {self.tries + 1} of at most "
                f"{self.retries + 1})"
            )
        elif not kept:
            text += (
                "; no second try in this job" if self.tries == 1 else f"; no further try ({self.tries} tries)"
            )
        self._decide(text)

    def _decide(self, text: str) -> None:
        self.decisions.append((self.steps, text))
        if self.note is not None:
            self.note(f"{self.label}, step {self.steps}: {text}")
