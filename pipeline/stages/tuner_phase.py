"""One phase of the input_dist tuner (`pipeline.stages.tuner`): its plan of steps, the times
measured, and what the ranks agreed on, round by round."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["Phase", "all_reduce_sum"]


@dataclass(kw_only=True, slots=True)
class Phase:
    """One tuning phase: rounds of blocks, each candidate once per round in a rotated order."""

    candidates: list[str]
    baseline: str
    kind: str
    """"tuning", "re-checking" or "tuning again" (after a tuning without valid rounds)."""
    rounds: int
    """Rounds the phase runs (a first tuning may stop its losers after the first)."""
    plan: list[tuple[str, int, bool]] = field(default_factory=list)
    """(schedule, round, timed) per step: a first tuning plans its first round, then the rest."""
    times: dict[tuple[int, str], list[float]] = field(default_factory=dict)
    agreed: dict[int, dict[str, float]] = field(default_factory=dict)
    """Per round already agreed across ranks, each candidate's summed block median."""
    dropped: dict[str, float] = field(default_factory=dict)
    """Candidates ruled out after the first round, with their ratio to that round's best."""
    interrupted: int = 0
    """Timed steps lost to an interruption (an eval step, an exception, a reset)."""
    reason: str = ""
    """Why these candidates (a prediction narrowed them), put before the decision's reason."""

    @classmethod
    def tuning(
        cls,
        candidates: list[str],
        baseline: str,
        *,
        rounds: int,
        block: int,
        settle: int,
        warmup: int,
        visit: int,
        kind: str = "tuning",
        first: str | None = None,
    ) -> Phase:
        """A tuning phase of `candidates`: warm-up (under `first`, default the baseline) and visits
        (untimed), then its first round; the tuner plans the others after it."""
        phase = cls(candidates=candidates, baseline=baseline, kind=kind, rounds=rounds)
        visits = [(s, -1, False) for s in candidates for _ in range(visit)]
        phase.plan = [(first or baseline, -1, False)] * warmup + visits
        phase.add_round(0, block=block, settle=settle)
        return phase

    @classmethod
    def recheck(cls, choice: str, runner_up: str, *, rounds: int, block: int, settle: int) -> Phase:
        """A re-check: `rounds` paired rounds of the choice (the baseline) and the runner-up."""
        phase = cls(candidates=[choice, runner_up], baseline=choice, kind="re-checking", rounds=rounds)
        for k in range(rounds):
            phase.add_round(k, block=block, settle=settle)
        return phase

    def add_round(self, k: int, *, block: int, settle: int) -> None:
        shift = k % len(self.candidates)
        for name in self.candidates[shift:] + self.candidates[:shift]:  # no schedule always first
            # the first `settle` steps carry the switch (batches in flight started under the
            # previous schedule) and are not timed
            self.plan += [(name, k, i >= settle) for i in range(block)]

    def agree(self, done: int, agree: Callable[[list[float]], list[float]]) -> None:
        """The ranks agree on the block medians of rounds up to `done` not agreed yet (summed)."""
        if len(self.agreed) >= done:
            return
        first = len(self.agreed)
        summed = agree([m for k in range(first, done) for m in self.medians(k)])
        n = len(self.candidates)
        for k in range(first, done):
            self.agreed[k] = dict(
                zip(self.candidates, summed[(k - first) * n : (k - first + 1) * n], strict=True)
            )

    def drop_losers(self, above: float) -> None:
        """After the first round: stop timing the candidates slower than `above` times its best
        (the baseline too: that round's best then takes its place)."""
        first = self.agreed[0]
        best = min((v for v in first.values() if math.isfinite(v)), default=math.inf)
        if not (math.isfinite(best) and best > 0):
            return
        for s in list(self.candidates):
            if first[s] / best > above:
                self.candidates.remove(s)
                self.dropped[s] = first[s] / best
        if self.baseline in self.dropped:  # the round's best is kept without further evidence
            self.baseline = min(self.candidates, key=first.__getitem__)

    def per_round(self) -> list[dict[str, float]]:
        """Per agreed round, in order, each candidate's summed block median (what `decide` reads)."""
        return [{s: self.agreed[k][s] for s in self.candidates} for k in sorted(self.agreed)]

    def medians_ms(self) -> dict[str, float]:
        """Per schedule timed in the first round, the median over the agreed rounds of its summed
        block medians, in ms (where any is finite)."""
        medians = {}
        for s in set(self.agreed[0]):
            finite = [r[s] for r in self.agreed.values() if s in r and math.isfinite(r[s])]
            if finite:
                medians[s] = statistics.median(finite) * 1e3
        return medians

    def medians(self, k: int) -> list[float]:
        """Round k's median step time per candidate (inf where none was timed)."""
        return [
            statistics.median(self.times[k, s]) if self.times.get((k, s)) else math.inf
            for s in self.candidates
        ]


def all_reduce_sum(values: list[float]) -> list[float]:
    """`values` summed over the ranks of the default process group (as they are at one rank): how
    the tuner's ranks agree."""
    if not (dist.is_available() and dist.is_initialized()):
        return values
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()
