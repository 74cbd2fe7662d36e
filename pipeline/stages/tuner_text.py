"""The tuner's words, in one place: what it compares, what it chose and by how much, and when it
looks again. `Tuner.reason` and `repr(tuner)` (what `print(pipe.tuner)` shows) are made here;
`decide()` stays numbers only.
"""

from __future__ import annotations

import statistics

from pipeline.stages.schedule import SCHEDULES, Decision
from pipeline.stages.tuner_phase import Phase

__all__ = [
    "ONE_RANK",
    "concluded",
    "decided_repr",
    "decision_reason",
    "next_look",
    "no_valid_rounds",
    "ruled_out",
    "schedule_words",
    "tuning_repr",
]

WHAT = (
    "when the next batch's input_dist waits for its splits (before or after forward) and on which "
    "process group its all-to-alls run (one of their own, or torchrec's)"
)
"""What the input_dist schedules differ in (`pipeline.stages.schedule`)."""

ONE_RANK = "one rank: the input all-to-alls move nothing, so every schedule does the same work"
"""Why a one-rank pipeline keeps torchrec's order without trials."""


def schedule_words(name: str) -> str:
    """`name` and what it does, e.g. "early (splits before forward, own process group)"."""
    if name == "late":
        return "late (torchrec's order)"
    schedule = SCHEDULES[name]
    when = "before" if schedule.early_splits else "after"
    group = "own process group" if schedule.own_group else "torchrec's process group"
    return f"{name} (splits {when} forward, {group})"


def _rounds(n: int) -> str:
    return f"{n} paired round{'s' if n != 1 else ''}"


def _percent(ratio: float) -> str:
    """A step-time ratio to the baseline, as "4.2 % faster", "1.0 % slower" or "as fast"."""
    if abs(1 - ratio) < 0.0005:
        return "as fast"
    return f"{abs(1 - ratio) * 100:.1f} % {'faster' if ratio < 1 else 'slower'}"


def decision_reason(decision: Decision, *, margin: float) -> str:
    """Why `decide()` chose what it chose: the winner and by how much, or why the baseline was
    kept and how the others did (the median over the valid rounds of their step-time ratio)."""
    medians = {s: statistics.median(r) for s, r in decision.ratios.items() if r}
    rounds = max((len(r) for r in decision.ratios.values()), default=0)
    if not decision.ratios:
        return f"kept {schedule_words(decision.baseline)}, the only schedule left after the first round"
    if decision.choice != decision.baseline:
        gain = _percent(medians[decision.choice])
        return (
            f"{schedule_words(decision.choice)} is {gain} than {schedule_words(decision.baseline)} "
            f"over {_rounds(rounds)}"
        )
    others = ", ".join(f"{s} {_percent(v)}" for s, v in medians.items())
    return (
        f"kept {schedule_words(decision.baseline)}: no other schedule was faster by more than "
        f"{margin * 100:.0f} % in the median and in every one of {_rounds(rounds)} ({others})"
    )


def concluded(decision: Decision, phase: Phase, *, margin: float, valid: bool, again_at: int | None) -> str:
    """The reason of a phase's decision: why `decide()` chose (`valid` rounds) or why it had
    nothing to compare, then the schedules the first round ruled out, after why the phase
    measured these candidates (`phase.reason`: a prediction narrowed them)."""
    if valid:
        reason = decision_reason(decision, margin=margin)
    else:
        reason = no_valid_rounds(phase.baseline, interrupted=phase.interrupted, again_at=again_at)
    if phase.dropped:
        reason += f"; {ruled_out(phase.dropped)}"
    return f"{phase.reason}; {reason}" if phase.reason else reason


def no_valid_rounds(baseline: str, *, interrupted: int, again_at: int | None) -> str:
    """Why a tuning had nothing to compare, what it kept, and when it tunes again."""
    if interrupted:
        why = (
            "every round was interrupted by an eval step, an exception or a reset during its timed "
            f"steps ({interrupted} timed steps lost)"
        )
    else:
        why = "no round had a timed step of every schedule on every rank"
    then = f"tunes again at step {again_at}" if again_at is not None else "does not tune again"
    return f"kept {schedule_words(baseline)}: no valid rounds to compare, since {why}; {then}"


def ruled_out(dropped: dict[str, float]) -> str:
    """The schedules the first round ruled out, with their step time over that round's best."""
    names = ", ".join(f"{s} ({ratio:.2f}x the best step time)" for s, ratio in dropped.items())
    return f"ruled out after the first round as much slower: {names}"


def next_look(next_check: int | None, steps: int) -> str:
    """When the tuner re-checks its choice against the runner-up (or that it never does)."""
    if next_check is None:
        return "never re-checks"
    return f"re-checks against the runner-up at step {next_check} ({next_check - steps} steps from now)"


def tuning_repr(kind: str, candidates: list[str], *, steps_left: int, running: str) -> str:
    """A tuner still measuring (`kind`: tuning, re-checking...): what it compares, how long at
    most, what runs now."""
    names = ", ".join(schedule_words(s) for s in candidates)
    return (
        f"Tuner({kind}: compares {WHAT}: {names}; decides in at most {steps_left} more steps; "
        f"{running} runs now)"
    )


def decided_repr(step: int, reason: str, look: str | None) -> str:
    """A tuner that has decided: at which step, why, and when it looks again (None: the reason
    says it)."""
    return f"Tuner(at step {step}: {reason}{f'; {look}' if look else ''})"
