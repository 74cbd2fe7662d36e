"""The "auto" input_dist schedule: a Tuner that chooses among `pipeline.stages.schedule.SCHEDULES` by paired,
interleaved measurement of real training steps, cheaply, and can be saved with a checkpoint.

Every step a worse schedule runs is lost time, so the trials are short, a schedule that the first
round already rules out (more than `drop_above` times the best of that round) runs no more rounds,
and with a `predictor` (the cost model, `pipeline.predictor`) the tuner starts on the predicted best
and measures only the schedules predicted within `noise` of it (`pipeline.stages.prediction`): none
when the model is sure. A restarted job reloads the decision (`state_dict()`) instead of tuning again.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from pipeline.stages.prediction import start_from
from pipeline.stages.schedule import SCHEDULES, Decision, decide
from pipeline.stages.trials import Phase, all_reduce_sum

__all__ = ["Tuner"]


class Tuner:
    """Chooses the input_dist schedule by paired, interleaved measurement, and re-checks it later.

    Tuning: `warmup` steps under `baseline`, `visit` untimed steps under each candidate (first-use
    costs: a new process group, its first collectives), then rounds in each of which every candidate
    runs a block of `block` consecutive steps, the order rotated between rounds; the first `settle`
    steps of a block carry the switch and are not timed. After the first round the ranks agree on its
    block medians, and candidates slower than `drop_above` times that round's best stop there (the
    baseline too: that round's best then takes its place). After `rounds` rounds, `decide` keeps the
    baseline unless another schedule is significantly faster. A step's time runs from the start of
    one `progress()` to the start of the next (what the caller does between steps counts). The ranks
    agree by summing their block medians with an all_reduce, so all of them switch at the same step.
    With a `predictor`, `start_from_prediction` (at the first batch) narrows the candidates first.

    Re-check: `recheck_after` steps after a decision, the choice and the runner-up run `recheck_rounds`
    paired rounds; the runner-up replaces the choice only if it wins by the same rule. The interval
    then doubles (300, 600, 1200, ... steps by default). Between checks a step costs one comparison.

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
        predictor: `predictor(model, batch)` -> predicted step ms per schedule, or None; called
            once on every rank at the first batch (it may run collectives: `pipeline.predictor`'s
            probes the link). None: every candidate is measured.
        noise: schedules predicted within this fraction of the best are measured.
    """

    def __init__(
        self,
        *,
        candidates: tuple[str, ...] = ("late", "early", "late-own", "early-shared"),
        baseline: str = "late",
        warmup: int = 2,
        block: int = 4,
        rounds: int = 3,
        settle: int = 1,
        visit: int = 1,
        margin: float = 0.03,
        drop_above: float = 1.25,
        recheck_after: int = 300,
        recheck_rounds: int = 2,
        clock: Callable[[], float] = time.perf_counter,
        agree: Callable[[list[float]], list[float]] | None = None,
        predictor: Callable[[Any, Any], dict[str, float] | None] | None = None,
        noise: float = 0.05,
    ) -> None:
        unknown = set(candidates) - set(SCHEDULES)
        if unknown or baseline not in candidates or not 0 < settle < block or rounds < 1 or visit < 0:
            raise ValueError(f"bad tuner settings: candidates {candidates}, baseline {baseline!r}")
        self._block, self._settle, self._margin, self._drop = block, settle, margin, drop_above
        self._recheck_rounds, self._interval = recheck_rounds, recheck_after
        self._warmup, self._visit, self._predictor, self._noise = warmup, visit, predictor, noise
        self._clock = clock
        self._agree = agree or all_reduce_sum
        self._phase: Phase | None = self._first_phase(list(candidates), baseline, rounds)
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
        """Per schedule, the predicted step in ms (averaged over ranks), if a predictor gave one."""

    def _first_phase(self, candidates: list[str], baseline: str, rounds: int) -> Phase:
        phase = Phase(candidates=candidates, baseline=baseline, rounds=rounds)
        visits = [(s, -1, False) for s in candidates for _ in range(self._visit)]
        phase.plan = [(baseline, -1, False)] * self._warmup + visits
        phase.add_round(0, block=self._block, settle=self._settle)
        return phase

    def start_from_prediction(self, model: Any, batch: Any) -> None:
        """Once, on every rank, before the first step: start on the predicted best schedule and
        measure only those predicted within `noise` of it; with none, decide now (no trials). The
        ranks average the predictions first, so all of them plan alike. A no-op without a predictor,
        after the first step, or once a decision is loaded."""
        predictor, self._predictor = self._predictor, None
        if predictor is None or self._steps or self.decisions or self._phase is None:
            return
        try:
            predicted = predictor(model, batch) or {}
        except Exception:  # a failed prediction leaves the trials as they were, on every rank
            predicted = {}
        candidates = self._phase.candidates
        *summed, ranks = self._agree([float(predicted.get(s, math.nan)) for s in candidates] + [1.0])
        averaged = {s: v / ranks for s, v in zip(candidates, summed, strict=True)}
        start = start_from(averaged, tuple(candidates), noise=self._noise)
        if start is None:
            return
        self.predicted_ms = averaged
        if len(start.trials) > 1:
            self._phase = self._first_phase(list(start.trials), start.best, self._phase.rounds)
            self._phase.reason = start.reason
            return
        decision = Decision(choice=start.best, baseline=start.best, ratios={}, reason=start.reason)
        self.choice, self._phase, self._next_check = start.best, None, None  # sure: no trials, no re-check
        self.decisions.append((0, decision))

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
        if self._phase is not None:
            what = "re-checking" if self.decisions else "tuning"
            return (
                f"Tuner({what} {', '.join(self._phase.candidates)}: at most {self.steps_left} more "
                f"steps; schedule so far {self.choice or self._phase.baseline!r})"
            )
        after = f"; re-check at step {self._next_check}" if self._next_check else ""
        return f"Tuner(chose {self.choice!r} at step {self.decisions[-1][0]}: {self.reason}{after})"

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

    def interrupt(self) -> None:
        """A step ended abnormally (or an eval step ran between): do not time across it."""
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
        self.predicted_ms = dict(state.get("predicted_ms", {}))
        self._phase, self._pos, self._last, self._predictor = None, 0, None, None

    def _start_recheck(self) -> None:
        last = self.decisions[-1][1]
        ratios = {s: statistics.median(r) for s, r in last.ratios.items() if r}
        ratios[last.baseline] = 1.0
        others = sorted((v, s) for s, v in ratios.items() if s != self.choice)
        if not others:
            self._next_check = None
            return
        self._phase = Phase(
            candidates=[self.choice, others[0][1]], baseline=self.choice, rounds=self._recheck_rounds
        )
        for k in range(self._recheck_rounds):
            self._phase.add_round(k, block=self._block, settle=self._settle)
        self._pos = 0

    def _end_of_round(self) -> None:
        """The plan ran out: agree on the rounds run, then drop losers and go on, or decide."""
        phase = self._phase
        done = phase.plan[-1][1] + 1
        if len(phase.agreed) < done:
            first = len(phase.agreed)
            summed = self._agree([m for k in range(first, done) for m in phase.medians(k)])
            n = len(phase.candidates)
            for k in range(first, done):
                row = summed[(k - first) * n : (k - first + 1) * n]
                phase.agreed[k] = dict(zip(phase.candidates, row, strict=True))
        if done == 1 and phase.rounds > 1:  # a first tuning's first round: rule losers out, go on
            if self._drop > 0:
                self._drop_losers(phase)
            if len(phase.candidates) > 1:
                for k in range(1, phase.rounds):
                    phase.add_round(k, block=self._block, settle=self._settle)
                return
        self._conclude(phase)

    def _drop_losers(self, phase: Phase) -> None:
        first = phase.agreed[0]
        best = min((v for v in first.values() if math.isfinite(v)), default=math.inf)
        if not (math.isfinite(best) and best > 0):
            return
        for s in list(phase.candidates):
            if first[s] / best > self._drop:
                phase.candidates.remove(s)
                phase.dropped[s] = first[s] / best
        if phase.baseline in phase.dropped:  # the round's best is kept without further evidence
            phase.baseline = min(phase.candidates, key=first.__getitem__)

    def _conclude(self, phase: Phase) -> None:
        per_round = [{s: phase.agreed[k][s] for s in phase.candidates} for k in sorted(phase.agreed)]
        decision = decide(per_round, baseline=phase.baseline, margin=self._margin)
        if phase.dropped:
            ruled_out = ", ".join(f"{s} {r:.2f}x the best" for s, r in phase.dropped.items())
            decision.reason += f"; ruled out after the first round: {ruled_out}"
        if phase.reason:
            decision.reason = f"{phase.reason}; {decision.reason}"
        for s in set(phase.agreed[0]):
            finite = [r[s] for r in phase.agreed.values() if s in r and math.isfinite(r[s])]
            if finite:
                self.medians_ms[s] = statistics.median(finite) * 1e3
        self.decisions.append((self._steps, decision))
        self.choice = decision.choice
        self._phase = None
        if self._interval > 0:
            self._next_check = self._steps + self._interval
            self._interval *= 2
