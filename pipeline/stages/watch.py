"""`ScheduleWatch`: the default input_dist schedule, "adaptive". It runs torchrec's order ("late")
and watches what the job's own steps show anyway: the step time, and the blocked share of it: the
time the training thread is blocked in the input all-to-alls' waits (the splits wait and, in
forward, the values wait), each read with a clock around a call the pipeline makes anyway, plus the
time it spends off the CPU in backward (where, on CPU, backward's collectives queue behind the next
batch's input all-to-all, and wait for the peers). Of the two, the second is most of the figure on
a network-bound CPU job (38-49 % of the step against 1-3 % in the waits); both are time that the
early schedule can hide. Where that share is large and steady, every rank moves to "early" (the
splits waited before forward, the all-to-alls on a process group of their own, created at that
step), and keeps it only where the steps after are faster: the rule of `pipeline.stages.step_watch`,
whose constants come from measurements (docs/reference.md, "The default schedule").

Where the statuses cannot ride (one rank, `agreement=False`, a class that admits batches itself),
the ranks have no figures to agree on and torchrec's order is kept (`pin`).
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

from pipeline.stages import watch_text as text
from pipeline.stages.step_watch import FINAL, StepWatch, WatchPhase
from pipeline.stages.wait_clock import WaitClock

__all__ = ["ScheduleWatch", "WatchPhase"]


class ScheduleWatch(StepWatch):
    """Chooses the input_dist schedule from the job's own steps: "late" (torchrec's order) until
    the training thread is blocked (input all-to-alls' waits, off the CPU in backward) for
    `threshold` of the step, steadily; then "early",
    kept only where it is verified faster (`pipeline.stages.step_watch.StepWatch`, whose Args these
    are: window 8, verify 20, warmup 8, threshold 0.4, settle 2, margin 0.05, sure 0.5). The
    threshold comes from the corrected figure over 1 Gbit (docs/results/default-1gbit-run4.md):
    early paid 25 % at a share of 0.48, 6 % at 0.36, and lost 9 % at 0.26.
    """

    modes: ClassVar[tuple[str, str]] = ("late", "early")
    label: ClassVar[str] = "input_dist schedule"

    def __init__(self, *, threshold: float = 0.4, **settings: Any) -> None:
        super().__init__(threshold=threshold, **settings)
        self.waits = WaitClock(self.clock)
        """Where the input_dist waits are timed (None-ed by `active_clock` once the watch ends)."""

    @property
    def schedule(self) -> str:
        """The schedule in use."""
        return self.mode

    def step(self) -> str:
        """At the start of each training step: the schedule to run it under."""
        if self._pending is not None or self.phase not in FINAL:
            self.waits.thread = threading.get_ident()
        return super().step()

    def _parts(self) -> tuple[float, float]:
        return self.waits.take()

    @property
    def active_clock(self) -> WaitClock | None:
        """The clock the input_dist waits report to, while the watch still watches or tries."""
        return None if self.phase in FINAL else self.waits

    @property
    def parts(self) -> tuple[float, float] | None:
        """Of `share`, this rank's median share in the input all-to-alls' waits and off the CPU in
        backward, over the same window (None before a full window)."""
        if len(self._samples) < self.window:
            return None
        return self.median_part(0), self.median_part(1)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "schedule": self.mode}

    def __repr__(self) -> str:
        return text.watch_repr(self)

    def _switched_text(self, share: float, clear: bool) -> str:
        waits, idle = self.parts or (0.0, 0.0)
        return text.switched(self, share, waits, idle, clear=clear)

    def _verdict_text(self, *, kept: bool) -> str:
        return text.verdict(self, kept=kept)

    def _pinned_text(self, reason: str) -> str:
        return text.pinned(reason)
