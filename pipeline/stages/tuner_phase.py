"""One phase of the input_dist tuner (`pipeline.stages.tuner`): its plan of steps, the times
measured, and what the ranks agreed on, round by round."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

__all__ = ["Phase"]


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

    def add_round(self, k: int, *, block: int, settle: int) -> None:
        shift = k % len(self.candidates)
        for name in self.candidates[shift:] + self.candidates[:shift]:  # no schedule always first
            # the first `settle` steps carry the switch (batches in flight started under the
            # previous schedule) and are not timed
            self.plan += [(name, k, i >= settle) for i in range(block)]

    def medians(self, k: int) -> list[float]:
        """Round k's median step time per candidate (inf where none was timed)."""
        return [
            statistics.median(self.times[k, s]) if self.times.get((k, s)) else math.inf
            for s in self.candidates
        ]
