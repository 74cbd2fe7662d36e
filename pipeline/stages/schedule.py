"""The input_dist schedules, each two choices: whether the splits all-to-all of batch i+1 is waited
for before forward of batch i ("early") or after it ("late", torchrec's order), and whether the
input all-to-alls run on a process group of their own (`pipeline.stages.groups.InputDistGroups`) or
on torchrec's; and the paired decision rule the "auto" tuner (`pipeline.stages.tuner`) chooses by.
Numerics are the same under every schedule. docs/reference.md, "Schedules", weighs them.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

__all__ = ["SCHEDULES", "Decision", "Schedule", "decide", "runner_up"]


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


@dataclass(kw_only=True, slots=True)
class Decision:
    """What a tuning phase concluded, and why."""

    choice: str
    baseline: str
    """The schedule the ratios are relative to."""
    ratios: dict[str, list[float]]
    """Per schedule, its block median over the baseline's in the same round, one per valid round."""
    reason: str = ""
    """Why, in words (`pipeline.stages.tuner_text`; the tuner writes it)."""


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
        The choice; among several significant winners, the lowest median ratio. Its `reason` is
        left to the caller (`pipeline.stages.tuner_text.decision_reason` words it).
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
    choice = min(winners, key=winners.get) if winners else baseline
    return Decision(choice=choice, baseline=baseline, ratios=ratios)


def runner_up(decision: Decision, choice: str) -> str | None:
    """What a re-check compares `choice` with: the other schedule of `decision` with the lowest
    median ratio to its baseline (the baseline's is 1); None where there is none."""
    ratios = {s: statistics.median(r) for s, r in decision.ratios.items() if r}
    ratios[decision.baseline] = 1.0
    others = sorted((v, s) for s, v in ratios.items() if s != choice)
    return others[0][1] if others else None
