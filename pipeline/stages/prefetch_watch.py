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

from pipeline.stages import watch_text as text
from pipeline.stages.step_watch import FINAL, StepWatch

__all__ = ["PrefetchWatch"]


class PrefetchWatch(StepWatch):
    """Whether the prefetch stage runs "inline" (from the start) or "ahead" (once verified faster).
    The Args are `StepWatch`'s; the defaults: window 8, verify 20, warmup 8, threshold 0.2, settle 2,
    margin 0.05, sure 0.5.
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

    def _switched_text(self, share: float, clear: bool) -> str:
        return text.prefetch_switched(self, share, clear=clear)

    def _verdict_text(self, *, kept: bool) -> str:
        return text.prefetch_verdict(self, kept=kept)

    def _pinned_text(self, reason: str) -> str:
        return text.prefetch_pinned(reason)

    def __repr__(self) -> str:
        return text.prefetch_repr(self)
