"""The schedule watch's words, in one place (as `pipeline.stages.tuner_text` is the tuner's): what
it saw when it moved, its verdict, and what `print(pipe.tuner)` shows. The watch stays numbers only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.stages.tuner_text import schedule_words

if TYPE_CHECKING:
    from pipeline.stages.watch import ScheduleWatch

__all__ = ["pinned", "switched", "verdict", "watch_repr"]


def pinned(reason: str) -> str:
    """Torchrec's order kept without watching, and why."""
    return f"kept {schedule_words('late')}: {reason}"


def switched(w: ScheduleWatch, share: float, waits: float, idle: float) -> str:
    """The move to early: the ranks' shares that triggered it, this rank's parts, what the switch
    creates and how long it is verified."""
    shares = ", ".join(f"{v:.0%}" for v in w.shares)
    return (
        f"the host blocked on the input all-to-alls {share:.0%} of the step (median over "
        f"{w.window} steps, mean over {len(w.shares)} ranks: {shares}; this rank "
        f"{waits:.0%} in their waits and {idle:.0%} off the CPU in backward; at least "
        f"{w.threshold:.0%} for {w.window + 1} batches in a row): trying "
        f"{schedule_words('early')} from the next step, its "
        "all-to-alls on a process group of their own ('pipeline_input_dist', created then; on "
        f"NCCL one more communicator); it is verified over {w.settle} + {w.verify} steps"
    )


def verdict(w: ScheduleWatch, unsure: list[bool], *, kept: bool) -> str:
    """Early kept, or torchrec's order again: every rank's ratio, and the rule it met or missed."""
    shown = ", ".join(f"{r:.2f}{' (not sure)' if u else ''}" for r, u in zip(w.ratios, unsure, strict=True))
    before = "the steps before (the faster half's median)"
    rule = (
        f"at most {1 - w.margin:.2f}, and at least {w.sure:.0%} of the steps after shorter "
        f"than the steps before, on every rank; this rank: {w.faster_steps:.0%}"
    )
    if kept:
        return (
            f"kept {schedule_words('early')}: the median step under it over {before} was {shown} "
            f"on the ranks ({rule})"
        )
    return (
        f"back to {schedule_words('late')} from the next step: the median step under early over {before} "
        f"was {shown} on the ranks (kept needs {rule}); no second try in this job"
    )


def watch_repr(w: ScheduleWatch) -> str:
    """What `print(pipe.tuner)` shows under the default schedule."""
    from pipeline.stages.step_watch import WatchPhase

    head = f"input_dist schedule: adaptive, running {schedule_words(w.schedule)}"
    if w.phase is WatchPhase.WATCHING:
        seen = w.share
        seen_text = "not yet a full window" if seen is None else f"{seen:.0%} of the step on this rank"
        return (
            f"{head}; watching how long the host blocks on the input all-to-alls over the last "
            f"{w.window} steps ({seen_text}; tries early once the ranks' mean has been at least "
            f"{w.threshold:.0%} for {w.window + 1} batches in a row)"
        )
    lines = [head] + [f"  step {step}: {line}" for step, line in w.decisions]
    if w.phase is WatchPhase.TRYING:
        lines.append(f"  verifying over {w.settle} + {w.verify} steps under early")
    return "\n".join(lines)
