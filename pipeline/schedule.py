"""When the next batch's input all-to-alls run: the input_dist schedules, and the "auto" tuner that
chooses among them by paired measurement.

A schedule is two independent choices:

- splits "early" or "late": the splits all-to-all of batch i+1 is waited for right after it is
  launched, before forward of batch i (its values all-to-all then has forward, backward and the
  optimizer step of i to finish in), or after forward of i (torchrec's order: no blocking round trip
  before forward);
- group "own" or "shared": the input all-to-alls run on a process group of their own
  (`rewrite.InputDistGroups`), so backward's collectives do not queue behind them, or on torchrec's
  group (no extra communicator, no second transfer competing for the link and the cores).

| name             | splits | group  |
|------------------|--------|--------|
| `"early"`        | early  | own    |
| `"late"`         | late   | shared | (torchrec's)
| `"early-shared"` | early  | shared |
| `"late-own"`     | late   | own    |

Numerics are the same under every schedule: only when the (identical) data moves changes.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["OPTIONS", "SCHEDULES", "Decision", "Schedule", "Tuner", "decide"]


@dataclass(frozen=True, slots=True)
class Schedule:
    """One input_dist schedule."""

    early_splits: bool
    """Wait for the next batch's splits before forward (True) or after it (False)."""
    own_group: bool
    """Input all-to-alls on a process group of their own (True) or on torchrec's (False)."""


SCHEDULES: dict[str, Schedule] = {
    "early": Schedule(early_splits=True, own_group=True),
    "late": Schedule(early_splits=False, own_group=False),
    "early-shared": Schedule(early_splits=True, own_group=False),
    "late-own": Schedule(early_splits=False, own_group=True),
}
OPTIONS = ("auto", *SCHEDULES)
"""Values of `input_dist_schedule=`."""


@dataclass(kw_only=True, slots=True)
class Decision:
    """What a tuning phase concluded, and why."""

    choice: str
    baseline: str
    """The schedule the ratios are relative to."""
    ratios: dict[str, list[float]]
    """Per schedule, its block median over the baseline's in the same round, one per valid round."""
    reason: str


def decide(rounds: list[dict[str, float]], *, baseline: str, margin: float) -> Decision:
    """The paired decision rule: keep `baseline` unless another schedule is faster by more than
    `margin` in the median over rounds, and faster in every round; a large gain (more than three
    margins in the median) may lose one round of three or more (one disturbed round on a busy
    machine must not hide a 10 % gain).

    Args:
        rounds: per round, each schedule's median step time in that round (any unit). Rounds
            with a missing or non-finite figure are left out: pairs are only compared in the same
            round, so slow drift of the machine cancels.
        baseline: the schedule to keep without significant evidence.
        margin: the relative gain the median ratio must show (0.03: 3 % faster).

    Returns:
        The choice; among several significant winners, the lowest median ratio.
    """
    valid = [r for r in rounds if baseline in r and all(math.isfinite(v) and v > 0 for v in r.values())]
    names = [s for s in (rounds[0] if rounds else {}) if s != baseline]
    ratios = {s: [r[s] / r[baseline] for r in valid] for s in names}

    def significant(r: list[float]) -> bool:
        if not r or statistics.median(r) >= 1 - margin:
            return False
        losses = sum(v >= 1 for v in r)
        return losses == 0 or (losses == 1 and len(r) >= 3 and statistics.median(r) < 1 - 3 * margin)

    winners = {s: statistics.median(r) for s, r in ratios.items() if significant(r)}
    if not winners:
        best = {s: statistics.median(r) for s, r in ratios.items() if r}
        detail = ", ".join(f"{s} {v:.3f}x" for s, v in best.items()) or "no valid rounds"
        return Decision(
            choice=baseline,
            baseline=baseline,
            ratios=ratios,
            reason=f"kept {baseline}: none significantly faster in {len(valid)} rounds ({detail})",
        )
    choice = min(winners, key=winners.get)
    return Decision(
        choice=choice,
        baseline=baseline,
        ratios=ratios,
        reason=f"{choice}: {winners[choice]:.3f}x {baseline} (median of {len(valid)} paired rounds)",
    )


@dataclass(kw_only=True, slots=True)
class _Phase:
    """One tuning phase: rounds of blocks, each schedule once per round in a rotated order."""

    candidates: list[str]
    baseline: str
    plan: list[tuple[str, int, bool]] = field(default_factory=list)
    """(schedule, round, timed) per step."""
    times: dict[tuple[int, str], list[float]] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        candidates: list[str],
        baseline: str,
        *,
        warmup: int,
        block: int,
        rounds: int,
        settle: int,
        visit: int = 0,
    ) -> _Phase:
        phase = cls(candidates=candidates, baseline=baseline)
        phase.plan = [(baseline, -1, False)] * warmup
        for name in candidates:  # first-use costs (a new process group, its first collectives)
            phase.plan += [(name, -1, False)] * visit
        for k in range(rounds):
            shift = k % len(candidates)
            for name in candidates[shift:] + candidates[:shift]:  # rotated: no schedule always first
                # untimed: the first `settle` steps carry batches started under the previous schedule
                phase.plan += [(name, k, i >= settle) for i in range(block)]
        return phase

    def medians(self, rounds: int) -> list[float]:
        """Per round and candidate, the median step time (inf where none was timed)."""
        return [
            statistics.median(self.times[k, s]) if self.times.get((k, s)) else math.inf
            for k in range(rounds)
            for s in self.candidates
        ]


class Tuner:
    """Chooses the input_dist schedule by paired, interleaved measurement, and re-checks it later.

    Tuning: `warmup` steps under `baseline`, `visit` untimed steps under each candidate (first-use
    costs), then `rounds` rounds in each of which every candidate runs a block of `block`
    consecutive steps (the order rotated between rounds; the first `settle` steps of a block carry
    the switch and are not timed). A step is timed from one `progress()` start to the next, so what
    the caller does between steps counts as in real training. `decide` then keeps the baseline
    unless another is significantly faster; the ranks sum their per-block medians with one
    all_reduce, so all of them switch at the same step.

    Re-check: `recheck_after` steps after a decision, the choice and the runner-up run `recheck_rounds`
    paired rounds; the runner-up replaces the choice only if it wins by the same rule. The interval
    then doubles (300, 600, 1200, ... steps by default).

    Args:
        candidates: schedules to compare (names from `SCHEDULES`).
        baseline: kept unless another is significantly faster; torchrec's order by default.
        warmup: steps before timing starts (first-batch costs: input dist creation, fx trace).
        block, settle: consecutive steps under one schedule, the first `settle` of them untimed.
        visit: untimed steps under each candidate before the first round.
        rounds: blocks per schedule in the first tuning.
        margin: relative gain a switch needs (see `decide`).
        recheck_after: steps from a decision to the next re-check; 0 never re-checks.
        recheck_rounds: rounds of a re-check.
        clock: seconds, monotonic (tests inject a fake one).
        agree: sums a list of floats over the ranks (tests inject one without a process group).
    """

    def __init__(
        self,
        *,
        candidates: tuple[str, ...] = ("late", "early", "late-own", "early-shared"),
        baseline: str = "late",
        warmup: int = 3,
        block: int = 5,
        rounds: int = 3,
        settle: int = 2,
        visit: int = 2,
        margin: float = 0.03,
        recheck_after: int = 300,
        recheck_rounds: int = 2,
        clock: Callable[[], float] = time.perf_counter,
        agree: Callable[[list[float]], list[float]] | None = None,
    ) -> None:
        unknown = set(candidates) - set(SCHEDULES)
        if unknown or baseline not in candidates or not 0 < settle < block or rounds < 1 or visit < 0:
            raise ValueError(f"bad tuner settings: candidates {candidates}, baseline {baseline!r}")
        self._block, self._margin, self._settle = block, margin, settle
        self._recheck_rounds, self._interval = recheck_rounds, recheck_after
        self._clock, self._agree = clock, agree or _all_reduce_sum
        self._phase: _Phase | None = _Phase.build(
            list(candidates), baseline, warmup=warmup, block=block, rounds=rounds, settle=settle, visit=visit
        )
        self._rounds, self._pos, self._steps = rounds, 0, 0
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

    @property
    def reason(self) -> str | None:
        """Why the current choice was made (the last decision's reason)."""
        return self.decisions[-1][1].reason if self.decisions else None

    @property
    def tuning(self) -> bool:
        """A tuning or re-check phase is under way: the schedule in use is one being measured."""
        return self._phase is not None

    @property
    def steps_left(self) -> int:
        """Steps left in the tuning or re-check under way (0 if none); it decides at the next."""
        return len(self._phase.plan) - self._pos if self._phase is not None else 0

    def __repr__(self) -> str:
        if self._phase is not None:
            what = f"re-checking {self.choice}" if self.choice else "tuning"
            return f"Tuner({what}: {self.steps_left} more steps over {', '.join(self._phase.candidates)})"
        after = f"; re-check at step {self._next_check}" if self._next_check else ""
        return f"Tuner(chose {self.choice} at step {self.decisions[-1][0]}: {self.reason}{after})"

    def next_schedule(self) -> str:
        """Called at the start of each training step; the schedule to run it under."""
        now = self._clock()
        if self._last is not None:
            started, k, name = self._last
            self._phase.times.setdefault((k, name), []).append(now - started)
            self._last = None
        self._steps += 1
        if self._phase is None:
            if self._next_check is None or self._steps < self._next_check:
                return self.choice
            self._start_recheck()
        if self._pos == len(self._phase.plan):
            self._conclude()
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

    def _start_recheck(self) -> None:
        last = self.decisions[-1][1]
        ratios = {s: statistics.median(r) for s, r in last.ratios.items() if r}
        ratios[last.baseline] = 1.0
        others = sorted((v, s) for s, v in ratios.items() if s != self.choice)
        if not others:
            self._next_check = None
            return
        self._phase = _Phase.build(
            [self.choice, others[0][1]],
            self.choice,
            warmup=0,
            block=self._block,
            rounds=self._recheck_rounds,
            settle=self._settle,
        )
        self._rounds = self._recheck_rounds
        self._pos = 0

    def _conclude(self) -> None:
        phase, rounds = self._phase, self._rounds
        summed = self._agree(phase.medians(rounds))
        n = len(phase.candidates)
        per_round = [
            dict(zip(phase.candidates, summed[k * n : (k + 1) * n], strict=True)) for k in range(rounds)
        ]
        decision = decide(per_round, baseline=phase.baseline, margin=self._margin)
        for s in phase.candidates:
            finite = [r[s] for r in per_round if math.isfinite(r[s])]
            if finite:
                self.medians_ms[s] = statistics.median(finite) * 1e3
        self.decisions.append((self._steps, decision))
        self.choice = decision.choice
        self._phase = None
        if self._interval > 0:
            self._next_check = self._steps + self._interval
            self._interval *= 2


def _all_reduce_sum(values: list[float]) -> list[float]:
    if not (dist.is_available() and dist.is_initialized()):
        return values
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()
