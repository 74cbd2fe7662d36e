"""`PrefetchWatch`: Prefetch's ahead-or-inline choice on CPU under `prefetch_ahead="auto"`, by the
rule of `pipeline.stages.step_watch`. The stage starts inline (each module's `prefetch()` on the
training thread just before forward: the plain loop's order, nothing competing for the cores) and
the watch reads how long each step blocks in the prefetch stage, a clock around a wait the step
makes anyway. Nothing is observed while the caches still fill (a kernel that can say so is asked:
`caches_full()`), since a cold cache reads more than the steady state does. Where the stage takes
`threshold` of the step, steadily, every rank runs it ahead on the worker thread (the prefetch of
batch i+1 during backward of i) and keeps that only where the steps after are faster.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from pipeline.stages.step_watch import FINAL, StepWatch, WatchPhase

__all__ = ["PrefetchWatch"]


class PrefetchWatch(StepWatch):
    """Whether the prefetch stage runs "inline" (from the start) or "ahead" (once verified faster).
    The Args are `StepWatch`'s; the defaults: window 8, verify 20, warmup 8, threshold 0.2, settle 2,
    margin 0.05, sure 0.75.
    """

    modes: ClassVar[tuple[str, str]] = ("inline", "ahead")
    label: ClassVar[str] = "prefetch"

    def __init__(self, *, threshold: float = 0.2, **settings: Any) -> None:
        super().__init__(threshold=threshold, **settings)
        self.blocked = 0.0
        """Seconds the training thread blocked in the prefetch stage since the last step."""
        self.ready: Callable[[], bool] | None = None
        """Whether the kernels' caches are full (None: no kernel says; taken as full)."""
        self.ready_at: int | None = None
        """The step from which steps are observed (the caches full)."""
        self.alone_reason: str | None = None

    @property
    def clocked(self) -> bool:
        """Whether the prefetch stage's wait is timed (while the watch watches or tries)."""
        return self.phase not in FINAL

    def _parts(self) -> tuple[float]:
        blocked, self.blocked = self.blocked, 0.0
        return (blocked,)

    def _observing(self) -> bool:
        if self.ready_at is None and (self.ready is None or self.ready()):
            self.ready_at = self.steps
        return self.ready_at is not None

    def no_ride(self, reason: str) -> None:
        """Nothing rides: each rank decides from its own steps (the mode changes where the work
        runs, not what it computes, so ranks that decide apart still train alike)."""
        if self.phase not in FINAL and not self.alone:
            self.alone, self.alone_reason = True, reason

    def _rule(self) -> str:
        return (
            f"at most {1 - self.margin:.2f}, and at least {self.sure:.0%} of the steps after shorter "
            f"than the steps before, on every rank; this rank: {self.faster_steps:.0%}"
        )

    def _switched_text(self, share: float) -> str:
        shares = ", ".join(f"{v:.0%}" for v in self.shares)
        return (
            f"the training thread blocked in the prefetch stage {share:.0%} of the step inline "
            f"(median over {self.window} steps, mean over {len(self.shares)} rank(s): {shares}; "
            f"observed from step {self.ready_at}, once the caches were full; at least "
            f"{self.threshold:.0%} for {self.window + 1} figures in a row): trying it ahead on its "
            f"worker thread from the next step, verified over {self.settle} + {self.verify} steps"
        )

    def _verdict_text(self, unsure: list[bool], *, kept: bool) -> str:
        shown = ", ".join(
            f"{r:.2f}{' (not sure)' if u else ''}" for r, u in zip(self.ratios, unsure, strict=True)
        )
        if kept:
            return (
                f"prefetch runs ahead on its worker thread: the median step ahead over the steps "
                f"inline before (the faster half's median) was {shown} on the rank(s) ({self._rule()})"
            )
        return (
            f"prefetch runs inline again from the next step: the median step ahead over the steps inline "
            f"before (the faster half's median) was {shown} on the rank(s) (kept needs {self._rule()}); "
            "no second try in this job"
        )

    def _pinned_text(self, reason: str) -> str:
        return f"prefetch runs inline: {reason}"

    def __repr__(self) -> str:
        head = f"prefetch: auto, running {self.mode}"
        if self.alone_reason is not None:
            head += f"; each rank decides alone ({self.alone_reason})"
        if self.phase is WatchPhase.WATCHING:
            if self.ready_at is None:
                return f"{head}; waiting for the caches to fill before watching"
            seen = self.share
            seen_text = "not yet a full window" if seen is None else f"{seen:.0%} of the step on this rank"
            return (
                f"{head}; watching how long the training thread blocks in the prefetch stage over "
                f"the last {self.window} steps ({seen_text}; tries ahead once the ranks' mean has "
                f"been at least {self.threshold:.0%} for {self.window + 1} figures in a row)"
            )
        lines = [head] + [f"  step {step}: {line}" for step, line in self.decisions]
        if self.phase is WatchPhase.TRYING:
            lines.append(f"  verifying over {self.settle} + {self.verify} steps ahead")
        return "\n".join(lines)
