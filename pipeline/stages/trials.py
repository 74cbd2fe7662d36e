"""The trials of the "auto" tuner (`pipeline.stages.tuner.Tuner`): one phase's plan of steps, its
timings per round, and the sum over ranks that makes every rank decide alike."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["Phase", "all_reduce_sum"]


@dataclass(kw_only=True, slots=True)
class Phase:
    """One tuning phase: rounds of blocks, each candidate once per round in a rotated order."""

    candidates: list[str]
    baseline: str
    rounds: int
    """Rounds the phase runs (a first tuning may stop its losers after the first)."""
    plan: list[tuple[str, int, bool]] = field(default_factory=list)
    """(schedule, round, timed) per step: a first tuning plans its first round, then the rest."""
    times: dict[tuple[int, str], list[float]] = field(default_factory=dict)
    agreed: dict[int, dict[str, float]] = field(default_factory=dict)
    """Per round already agreed across ranks, each candidate's summed block median."""
    dropped: dict[str, float] = field(default_factory=dict)
    """Candidates ruled out after the first round, with their ratio to that round's best."""
    reason: str = ""
    """Why these candidates (a prediction narrowed them), prefixed to the decision's reason."""

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


def all_reduce_sum(values: list[float]) -> list[float]:
    """`values` summed over the ranks of the default process group (as they are at one rank)."""
    if not (dist.is_available() and dist.is_initialized()):
        return values
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()
