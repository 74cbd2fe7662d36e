"""The watches' words, in one place: what each saw when it moved, its verdict, and what printing it
shows, for the schedule watch (`print(pipe.tuner)`) and Prefetch's (`print(pipe.prefetch_watch)`),
and how a schedule is named (`schedule_words`). The watches stay numbers only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.stages.schedule import SCHEDULES
from pipeline.stages.step_watch import WatchPhase

if TYPE_CHECKING:  # the subclasses (`ScheduleWatch`, `PrefetchWatch`) import this module
    from pipeline.stages.step_watch import StepWatch

__all__ = [
    "NOT_ON_NCCL",
    "ONE_RANK",
    "WATCH_ADVICE",
    "pinned",
    "prefetch_pinned",
    "prefetch_repr",
    "prefetch_switched",
    "prefetch_verdict",
    "schedule_words",
    "switched",
    "verdict",
    "watch_repr",
]

ONE_RANK = "one rank: the input all-to-alls move nothing, so every schedule does the same work"
"""Why a one-rank pipeline keeps torchrec's order without watching."""
NOT_ON_NCCL = (
    "the watch's figure (the host's time blocked on the input all-to-alls) has not been measured on "
    "NCCL, where a wait blocks a stream rather than the host; pin input_dist_schedule='early' to try "
    "the other order"
)
"""Why the schedule watch keeps torchrec's order on NCCL."""
WATCH_ADVICE = "Give every rank the same ScheduleWatch and PrefetchWatch settings (or none)."
"""What to do where the ranks' live watches have different settings."""


def schedule_words(name: str) -> str:
    """`name` and what it does, e.g. "early (splits before forward, own process group)"."""
    if name == "late":
        return "late (torchrec's order)"
    schedule = SCHEDULES[name]
    when = "before" if schedule.early_splits else "after"
    group = "own process group" if schedule.own_group else "torchrec's process group"
    return f"{name} (splits {when} forward, {group})"


def _shares(w: StepWatch) -> str:
    return ", ".join(f"{v:.0%}" for v in w.shares)


def _ratios(w: StepWatch) -> str:
    """The job's step ratio after/before the switch (the ranks' mean) and each rank's."""
    mean = sum(w.ratios) / len(w.ratios)
    return f"{mean:.2f} (ranks: {', '.join(f'{r:.2f}' for r in w.ratios)})"


def _rule(w: StepWatch) -> str:
    """What a verdict needs, and how this rank's steps fared."""
    return (
        f"the ranks' mean at most {1 - w.margin:.2f} and none {1 + w.margin:.2f} or more; a rank's "
        "ratio is the median over every pair of a step after and a step before, the faster half of "
        f"each side; this rank's step after was shorter in {w.faster_steps:.0%} of the pairs"
    )


def _described(w: StepWatch, head: str, watched: str, unit: str, trying: str) -> str:
    """While watching: what it watches (`watched`) and when it tries the other mode; after: each
    decision, one a line (`trying`: the words for the mode being verified)."""
    if w.phase is WatchPhase.WATCHING:
        seen = w.share
        seen_text = "not yet a full window" if seen is None else f"{seen:.0%} of the step on this rank"
        return (
            f"{head}; watching how long {watched} over the last {w.window} steps ({seen_text}; "
            f"tries {w.modes[1]} once the ranks' mean has been at least {w.threshold:.0%} for "
            f"{w.window + 1} {unit} in a row)"
        )
    lines = [head] + [f"  step {step}: {line}" for step, line in w.decisions]
    if w.phase is WatchPhase.TRYING:
        lines.append(f"  verifying over {_verified(w)} {trying}")
    return "\n".join(lines)


# -- the schedule watch ------------------------------------------------------------------------


def pinned(reason: str) -> str:
    """Torchrec's order kept without watching, and why."""
    return f"kept {schedule_words('late')}: {reason}"


def switched(w: StepWatch, share: float, waits: float, idle: float, *, clear: bool) -> str:
    """The move to early: the ranks' blocked shares that triggered it, this rank's parts, what the switch
    creates and how long it is verified (`clear`: the switch came at the first figure)."""
    return (
        f"the training thread was blocked {share:.0%} of the step (median over "
        f"{w.window} steps, mean over {len(w.shares)} ranks: {_shares(w)}; this rank "
        f"{waits:.0%} in the input all-to-alls' waits and {idle:.0%} off the CPU in backward; "
        f"{_held(w, clear)}): trying {schedule_words('early')} from the next step, its "
        "all-to-alls on a process group of their own ('pipeline_input_dist', created then; on "
        f"NCCL one more communicator); it is verified over {_verified(w)}"
    )


def _held(w: StepWatch, clear: bool) -> str:
    """How the share held before the switch (`clear`: every rank's was twice the threshold at once)."""
    if clear:
        return f"at least {2 * w.threshold:.0%} on every rank: clear at the first figure"
    return f"at least {w.threshold:.0%} for {w.window + 1} figures in a row"


def _verified(w: StepWatch) -> str:
    return f"{w.settle} + {w.verify} steps (half as many where the steps after are clear)"


def verdict(w: StepWatch, *, kept: bool) -> str:
    """Early kept, or torchrec's order again: the job's ratio, every rank's, and the rule."""
    shown, rule = _ratios(w), _rule(w)
    if kept:
        return f"kept {schedule_words('early')}: the step under it over the step before was {shown} ({rule})"
    return (
        f"back to {schedule_words('late')} from the next step: the step under early over the step before "
        f"was {shown} (kept needs {rule}); no second try in this job"
    )


def watch_repr(w: StepWatch) -> str:
    """What `print(pipe.tuner)` shows under the default schedule."""
    head = f"input_dist schedule: adaptive, running {schedule_words(w.schedule)}"
    watched = "the training thread is blocked (input all-to-alls' waits, off the CPU in backward)"
    return _described(w, head, watched, "batches", "under early")


# -- Prefetch's watch --------------------------------------------------------------------------


def prefetch_pinned(reason: str) -> str:
    """The stage kept inline without watching, and why."""
    return f"prefetch runs inline: {reason}"


def prefetch_switched(w: StepWatch, share: float, *, clear: bool) -> str:
    """The move ahead: the ranks' shares that triggered it, when it began to observe, how long it
    is verified."""
    return (
        f"the training thread blocked in the prefetch stage {share:.0%} of the step inline "
        f"(median over {w.window} steps, mean over {len(w.shares)} rank(s): {_shares(w)}; "
        f"observed from step {w.ready_at}, once the caches were full; {_held(w, clear)}): trying it ahead "
        f"on its worker thread from the next step, verified over {_verified(w)}"
    )


def prefetch_verdict(w: StepWatch, *, kept: bool) -> str:
    """Ahead kept, or inline again: the job's ratio, every rank's, and the rule."""
    shown, rule = _ratios(w), _rule(w)
    if kept:
        return (
            "prefetch runs ahead on its worker thread: the step ahead over the step inline was "
            f"{shown} ({rule})"
        )
    return (
        f"prefetch runs inline again from the next step: the step ahead over the step inline was {shown} "
        f"(kept needs {rule}); no second try in this job"
    )


def prefetch_repr(w: StepWatch) -> str:
    """What `print(pipe.prefetch_watch)` shows."""
    head = f"prefetch: auto, running {w.mode}"
    if w.alone_reason is not None:
        head += f"; each rank decides alone ({w.alone_reason})"
    if w.phase is WatchPhase.WATCHING and w.ready_at is None:
        return f"{head}; waiting for the caches to fill before watching"
    return _described(w, head, "the training thread blocks in the prefetch stage", "figures", "ahead")
