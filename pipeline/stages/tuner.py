"""The "auto" input_dist schedule: a Tuner that chooses among `pipeline.stages.schedule.SCHEDULES`
by paired, interleaved measurement of real training steps, cheaply, and can be saved with a
checkpoint (a restarted job reloads the decision instead of tuning again). Every step a worse
schedule runs is lost time: the trials are short, and a schedule the first round rules out runs no
more rounds. With a `prior` (each schedule's predicted step, computed beforehand by the caller, e.g.
with `python -m benchmarks predict`) it measures fewer (`pipeline.stages.prediction`); it never
measures anything but the training steps it runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from pipeline.stages import tuner_text as text
from pipeline.stages.prediction import predicted_steps, start_from
from pipeline.stages.schedule import SCHEDULES, Decision, decide, runner_up
from pipeline.stages.tuner_phase import Phase, all_reduce_sum

__all__ = ["Tuner"]


class Tuner:
    """Chooses the input_dist schedule by paired, interleaved measurement, and re-checks it later.

    Tuning: `warmup` steps under `baseline`, `visit` untimed steps under each candidate, then rounds
    in which every candidate runs a block of `block` steps (order rotated between rounds; the first
    `settle` steps of a block are not timed). After the first round the ranks agree on its block
    medians and candidates slower than `drop_above` times its best stop there. After `rounds`
    rounds, `decide` keeps the baseline unless another schedule is significantly faster. A step runs
    from one `progress()` to the next, so what the caller does between steps counts. The ranks sum
    their medians with an all_reduce, so all of them switch at the same step.

    Re-check: `recheck_after` steps after a decision, the choice and the runner-up run
    `recheck_rounds` paired rounds (the interval then doubles). A tuning whose every round was
    interrupted keeps the baseline and tunes again at the next look. `reason` and `repr()` say it
    in words (`pipeline.stages.tuner_text`).

    Args:
        candidates: schedules to compare (names from `SCHEDULES`).
        baseline: kept unless another is significantly faster; torchrec's order by default.
        warmup: steps before timing starts (first-batch costs: input dist creation, fx trace).
        block: consecutive steps under one schedule.
        settle: untimed steps at the start of each block.
        visit: untimed steps under each candidate before the first round.
        rounds: blocks per schedule in the first tuning.
        margin: relative gain a switch needs (see `decide`).
        drop_above: after the first round, stop timing candidates slower than this times the
            round's best (0 disables).
        recheck_after: steps from a decision to the next re-check; 0 never re-checks.
        recheck_rounds: rounds of a re-check.
        clock: seconds, monotonic (tests inject a fake one).
        agree: sums a list of floats over the ranks (tests inject one without a process group).
        prior: predicted step in ms per schedule (the same on every rank), e.g. a
            `benchmarks.predictor.Prediction.schedule_ms(...)` saved by a tool; None: no prior.
        noise: schedules predicted within this fraction of the best are measured.
    """

    def __init__(
        self,
        *,
        candidates: tuple[str, ...] = ("late", "early", "late-own", "early-shared"),
        baseline: str = "late",
        warmup: int = 2,
        block: int = 4,
        rounds: int = 5,
        settle: int = 1,
        visit: int = 1,
        margin: float = 0.05,
        drop_above: float = 1.25,
        recheck_after: int = 0,
        recheck_rounds: int = 2,
        clock: Callable[[], float] = time.perf_counter,
        agree: Callable[[list[float]], list[float]] | None = None,
        prior: dict[str, float] | None = None,
        noise: float = 0.05,
    ) -> None:
        unknown = set(candidates) - set(SCHEDULES)
        if unknown or baseline not in candidates or not 0 < settle < block or rounds < 1 or visit < 0:
            raise ValueError(f"bad tuner settings: candidates {candidates}, baseline {baseline!r}")
        self._block, self._settle, self._margin, self._drop = block, settle, margin, drop_above
        self._recheck_rounds, self._interval = recheck_rounds, recheck_after
        self._clock = clock
        self._agree = agree or all_reduce_sum
        self._rounds, self._prior, self._noise = rounds, prior, noise
        self._phase: Phase | None = self._tuning(list(candidates), baseline, warmup=warmup, visit=visit)
        self._again: list[str] | None = None
        """The candidates of a tuning without valid rounds: the next look tunes them again."""
        self._pos = 0
        self._steps = 0
        self._next_check: int | None = None
        self._last: tuple[float, int, str] | None = None
        self.choice: str | None = None
        """The schedule kept, once decided (a re-check may change it)."""
        self.medians_ms: dict[str, float] = {}
        """Per schedule, the median over rounds of its block medians summed over ranks, in ms
        (from the first tuning; a re-check updates the two it compared)."""
        self.decisions: list[tuple[int, Decision]] = []
        """(step, decision) of the tuning and of every re-check, in order."""
        self.tuning_steps = 0
        """Steps run under a tuning or re-check plan so far (warm-up included)."""
        self.tuning_steps_by_schedule: dict[str, int] = {}
        """`tuning_steps` per schedule they ran under (what tuning cost is computed from)."""
        self.predicted_ms: dict[str, float] = {}
        """Per schedule, the predicted step in ms (the prior averaged over ranks), if one was given."""

    def start_from_prior(self) -> None:
        """Once, on every rank, before the first step: narrow the trials to the predicted best, the
        schedules predicted within `noise` of it and torchrec's order; where only torchrec's order
        is left, keep it with no trials. The ranks average the predictions first, so all of them
        plan alike (one small collective). A no-op without a prior, after the first step, or once a
        decision is loaded."""
        prior, self._prior = self._prior, None
        if prior is None or self._steps or self.decisions or self._phase is None:
            return
        phase = self._phase
        predicted = predicted_steps(prior, phase.candidates, self._agree)
        start = start_from(predicted, tuple(phase.candidates), noise=self._noise, keep=phase.baseline)
        if start is None:
            return
        self.predicted_ms = predicted
        if len(start.trials) == 1:
            self.settle(start.best, start.reason)
            return
        # the baseline stays torchrec's order where it is measured: a predicted best that does not
        # beat it significantly in the trials is not kept
        baseline = phase.baseline if phase.baseline in start.trials else start.best
        self._phase = self._tuning(list(start.trials), baseline, warmup=2, visit=1, first=start.best)
        self._phase.reason = start.reason

    @property
    def reason(self) -> str | None:
        """Why the current choice was made (the last decision's reason)."""
        return self.decisions[-1][1].reason if self.decisions else None

    @property
    def tuning(self) -> bool:
        """A tuning or re-check is under way: the schedule in use is one being measured."""
        return self._phase is not None

    @property
    def steps_left(self) -> int:
        """Steps until the current tuning or re-check decides (at most: a first round may stop
        losers early); 0 while none runs."""
        if self._phase is None:
            return 0
        per_round = len(self._phase.candidates) * self._block
        later = (self._phase.rounds - 1 - self._phase.plan[-1][1]) * per_round
        return len(self._phase.plan) - self._pos + max(later, 0)

    def __repr__(self) -> str:
        phase = self._phase
        if phase is not None:
            running = self.choice or phase.baseline
            if 0 < self._pos <= len(phase.plan):
                running = phase.plan[self._pos - 1][0]
            return text.tuning_repr(phase.kind, phase.candidates, steps_left=self.steps_left, running=running)
        # after a tuning without valid rounds, the reason says when it tunes again
        look = None if self._again is not None else text.next_look(self._next_check, self._steps)
        return text.decided_repr(self.decisions[-1][0], self.reason or "", look)

    def next_schedule(self) -> str:
        """Called at the start of each training step; the schedule to run it under."""
        self._steps += 1
        if self._phase is None and (self._next_check is None or self._steps < self._next_check):
            return self.choice  # the hot path once decided: no clock, no bookkeeping
        now = self._clock()
        if self._last is not None:
            started, k, name = self._last
            self._phase.times.setdefault((k, name), []).append(now - started)
            self._last = None
        if self._phase is None:
            self._start_recheck()
        while self._phase is not None and self._pos == len(self._phase.plan):
            self._end_of_round()
        if self._phase is None:
            return self.choice
        name, k, timed = self._phase.plan[self._pos]
        self._pos += 1
        self.tuning_steps += 1
        self.tuning_steps_by_schedule[name] = self.tuning_steps_by_schedule.get(name, 0) + 1
        if timed:
            self._last = (now, k, name)
        return name

    def settle(self, choice: str, reason: str) -> None:
        """Keep `choice` without trials and never re-check it (where the schedules cannot differ,
        or where the decision is known).

        Raises:
            ValueError: `choice` is not a schedule.
        """
        if choice not in SCHEDULES:
            raise ValueError(f"no input_dist schedule {choice!r}; one of {list(SCHEDULES)}")
        self.choice = choice
        self.decisions.append(
            (self._steps, Decision(choice=choice, baseline=choice, ratios={}, reason=reason))
        )
        self._phase, self._pos, self._last, self._next_check = None, 0, None, None

    def interrupt(self) -> None:
        """A step ended abnormally (or an eval step ran between): do not time across it."""
        if self._last is not None and self._phase is not None:
            self._phase.interrupted += 1
        self._last = None

    def state_dict(self) -> dict[str, Any]:
        """The decision, to save with a checkpoint: a tuner that loads it does not tune again.

        Returns an empty dict while the first tuning still runs (there is nothing to keep yet)."""
        if not self.decisions:
            return {}
        return {
            "choice": self.choice,
            "medians_ms": dict(self.medians_ms),
            "decisions": [(step, asdict(d)) for step, d in self.decisions],
            "steps": self._steps,
            "next_check": self._next_check,
            "interval": self._interval,
            "again": self._again,
            "predicted_ms": dict(self.predicted_ms),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a saved decision: from the next step on, run its choice (and its re-checks on the
        saved timetable). An empty state (saved mid-tuning) leaves the tuner as it is."""
        if not state:
            return
        if state["choice"] not in SCHEDULES:
            raise ValueError(
                f"a tuner state names schedule {state['choice']!r}, not one of {list(SCHEDULES)}"
            )
        self.choice = state["choice"]
        self.medians_ms = dict(state["medians_ms"])
        self.decisions = [(step, Decision(**d)) for step, d in state["decisions"]]
        self._steps, self._next_check, self._interval = state["steps"], state["next_check"], state["interval"]
        self._again = state.get("again")
        self.predicted_ms = dict(state.get("predicted_ms", {}))
        self._phase, self._pos, self._last, self._prior = None, 0, None, None

    def _tuning(self, candidates: list[str], baseline: str, **plan: Any) -> Phase:
        """A tuning phase with this tuner's rounds and blocks (`Phase.tuning`; `plan`: its warm-up,
        visits, kind and first schedule)."""
        return Phase.tuning(
            candidates, baseline, rounds=self._rounds, block=self._block, settle=self._settle, **plan
        )

    def _start_recheck(self) -> None:
        self._pos = 0
        if self._again is not None:  # the last tuning had no valid rounds: tune again
            again = self._tuning(self._again, self.choice, warmup=0, visit=0, kind="tuning again")
            self._phase, self._again = again, None
            return
        other = runner_up(self.decisions[-1][1], self.choice)
        if other is None:
            self._next_check = None
            return
        self._phase = Phase.recheck(
            self.choice, other, rounds=self._recheck_rounds, block=self._block, settle=self._settle
        )

    def _end_of_round(self) -> None:
        """The plan ran out: agree on the rounds run, then drop losers and go on, or decide."""
        phase = self._phase
        done = phase.plan[-1][1] + 1
        phase.agree(done, self._agree)
        if done == 1 and phase.rounds > 1:  # a first tuning's first round: rule losers out, go on
            if self._drop > 0:
                phase.drop_losers(self._drop)
            if len(phase.candidates) > 1:
                for k in range(1, phase.rounds):
                    phase.add_round(k, block=self._block, settle=self._settle)
                return
        self._conclude(phase)

    def _conclude(self, phase: Phase) -> None:
        decision = decide(phase.per_round(), baseline=phase.baseline, margin=self._margin)
        self.medians_ms.update(phase.medians_ms())
        self.decisions.append((self._steps, decision))
        self.choice = decision.choice
        self._phase = None
        valid = any(decision.ratios.values())
        if not valid and len(phase.candidates) > 1:
            self._again = [*phase.candidates, *phase.dropped]
        self._next_check = None
        if self._interval > 0 and (valid or self._again is not None):  # else nothing to re-check
            self._next_check = self._steps + self._interval
            self._interval *= 2
        again_at = self._next_check if self._again is not None else None
        decision.reason = text.concluded(
            decision, phase, margin=self._margin, valid=self._again is None, again_at=again_at
        )
