"""Whether running the prefetch stage ahead on its worker thread pays on this machine: `OverlapTrial`
measures it on real training steps and decides, the same way on every rank.

On CPU a prefetch whose reads are themselves CPU time competes with compute for the cores and can
cost more than it hides; that depends on the machine, the tables and the load, not on anything the
pipeline can read beforehand, so it is measured (docs/tiered.md, "Ahead or inline: the overlap
trial"). The ranks sum their block medians (an all_reduce), so all of them decide alike at the same
step; the stage stays inline unless running ahead is significantly faster
(`pipeline.stages.schedule.decide`). Re-checks repeat it (the first trial may run while caches fill).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist
from torchrec.distributed.comm import get_local_size

from pipeline.stages.schedule import decide
from pipeline.stages.tuner_phase import all_reduce_sum

__all__ = ["OverlapTrial", "TrialResult"]

_AHEAD, _INLINE = "ahead", "inline"
_BUSY = 0.85
"""Cores busier than this (process CPU x local ranks over wall x cores) while running ahead: the
reads' CPU fills them."""


@dataclass(frozen=True, slots=True)
class TrialResult:
    """What one trial measured (per step, the mean over ranks of each rank's median) and chose."""

    ahead: bool
    step_ms: dict[str, float]
    """Wall time of a step, "ahead" and "inline"."""
    cpu_ms: dict[str, float]
    """Process CPU time of a step (every thread), "ahead" and "inline"."""
    busy: float
    """Share of the cores the ranks on this host kept busy while running ahead."""
    reason: str


class OverlapTrial:
    """Decides, by paired measurement of training steps, whether the prefetch stage runs ahead.

    The caller runs `next_step()` at the start of every training step and runs that step ahead or
    inline as the answer says. Nothing is timed before `warmup` steps, nor while `busy()` is true
    (the input_dist tuner is comparing schedules); then `rounds` rounds of a block of `block` steps
    per mode (the first `settle` of each carry the switch and are not timed). A decision is re-checked
    `recheck_after` steps later, then at doubling intervals (0: never).

    Args:
        warmup, block, settle, rounds, margin, recheck_after: as above.
        clock, cpu_clock: wall and process CPU seconds (tests inject fake ones).
        agree: sums a list of floats over the ranks (tests inject one without a process group).
        cores, local_ranks: the cores this process may run on and the ranks on this host, for the
            reason's words (default: the affinity mask, and torchrec's `get_local_size`: the launcher's
            local world size, else the world size).
    """

    def __init__(
        self,
        *,
        warmup: int = 50,
        block: int = 4,
        settle: int = 1,
        rounds: int = 3,
        margin: float = 0.03,
        recheck_after: int = 500,
        clock: Callable[[], float] = time.perf_counter,
        cpu_clock: Callable[[], float] = time.process_time,
        agree: Callable[[list[float]], list[float]] | None = None,
        cores: int | None = None,
        local_ranks: int | None = None,
    ) -> None:
        if not 0 <= settle < block or rounds < 1 or warmup < 0:
            raise ValueError(f"bad overlap trial: block {block}, settle {settle}, rounds {rounds}")
        self._block, self._settle, self._rounds, self._margin = block, settle, rounds, margin
        self._clock, self._cpu_clock = clock, cpu_clock
        self._agree = agree or all_reduce_sum
        self._cores, self._local_ranks = cores, local_ranks
        self._steps = 0
        self._start = warmup
        self._interval = recheck_after
        self._plan: list[tuple[str, int, bool]] | None = None
        self._pos = 0
        self._last: tuple[float, float, str, int] | None = None
        self._times: dict[tuple[str, int], list[tuple[float, float]]] = {}
        self.result: TrialResult | None = None
        """The last decision (None before the first)."""
        self.decided_at: int | None = None
        """The step of the last decision."""

    @property
    def ahead(self) -> bool:
        """The mode decided (ahead until the first decision: the stage's choice before trials)."""
        return self.result is None or self.result.ahead

    def next_step(self, *, busy: bool = False) -> bool:
        """Called at the start of each training step; whether to run this step's stage ahead."""
        self._steps += 1
        if self._plan is None and self._steps < self._start:
            return self.ahead  # the hot path between trials: one comparison
        now = (self._clock(), self._cpu_clock())
        if self._last is not None:
            wall, cpu, mode, k = self._last
            self._times.setdefault((mode, k), []).append((now[0] - wall, now[1] - cpu))
            self._last = None
        if busy:
            return self.ahead  # another trial is measuring: no step is timed meanwhile
        if self._plan is None:
            self._plan, self._pos, self._times = self._make_plan(), 0, {}
        if self._pos == len(self._plan):
            self._conclude()
            return self.ahead
        mode, k, timed = self._plan[self._pos]
        self._pos += 1
        if timed:
            self._last = (*now, mode, k)
        return mode == _AHEAD

    def interrupt(self) -> None:
        """A step ended abnormally or an eval step ran between: do not time across it."""
        self._last = None

    def _make_plan(self) -> list[tuple[str, int, bool]]:
        plan = []
        for k in range(self._rounds):
            modes = (_AHEAD, _INLINE) if k % 2 == 0 else (_INLINE, _AHEAD)
            for mode in modes:
                plan += [(mode, k, i >= self._settle) for i in range(self._block)]
        return plan

    def _medians(self) -> list[float]:
        """Per round and mode: median wall, then per mode the median CPU over all its steps."""
        out = []
        for k in range(self._rounds):
            for mode in (_AHEAD, _INLINE):
                walls = [w for w, _ in self._times.get((mode, k), [])]
                out.append(statistics.median(walls) if walls else math.inf)
        for mode in (_AHEAD, _INLINE):
            cpus = [c for k in range(self._rounds) for _, c in self._times.get((mode, k), [])]
            out.append(statistics.median(cpus) if cpus else math.inf)
        return out

    def _conclude(self) -> None:
        ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        summed = self._agree(self._medians())
        rounds = [
            {_AHEAD: summed[2 * k], _INLINE: summed[2 * k + 1]}
            for k in range(self._rounds)
            if math.isfinite(summed[2 * k]) and math.isfinite(summed[2 * k + 1])
        ]
        decision = decide(rounds, baseline=_INLINE, margin=self._margin) if rounds else None
        ahead = decision is not None and decision.choice == _AHEAD
        step = {m: 1e3 * statistics.median([r[m] for r in rounds]) / ranks if rounds else math.nan
                for m in (_AHEAD, _INLINE)}  # fmt: skip
        cpu = {_AHEAD: 1e3 * summed[-2] / ranks, _INLINE: 1e3 * summed[-1] / ranks}
        busy = self._busy(cpu[_AHEAD], step[_AHEAD], ranks)
        self.result = TrialResult(ahead, step, cpu, busy, self._words(ahead, step, cpu, busy, ranks))
        self.decided_at = self._steps
        self._plan, self._last = None, None
        self._start = self._steps + self._interval if self._interval > 0 else math.inf
        self._interval *= 2

    def _busy(self, cpu_ms: float, step_ms: float, ranks: int) -> float:
        cores = self._cores or len(os.sched_getaffinity(0))
        if self._local_ranks is None:  # asked once: torchrec warns where the launcher did not say
            self._local_ranks = get_local_size(ranks) if ranks > 1 else 1
        local = self._local_ranks
        return cpu_ms * local / (step_ms * cores) if step_ms > 0 and math.isfinite(step_ms) else math.nan

    def _words(self, ahead: bool, step: dict, cpu: dict, busy: float, ranks: int) -> str:
        measured = (
            f"{step[_AHEAD]:.1f} ms a step ahead, {step[_INLINE]:.1f} inline; process CPU "
            f"{cpu[_AHEAD]:.1f} and {cpu[_INLINE]:.1f} ms a step; cores {busy:.0%} busy ahead "
            f"(median of {self._rounds} paired rounds, mean of {ranks} rank(s), step {self._steps})"
        )
        if ahead:
            return f"prefetch runs ahead on its worker thread: overlap pays ({measured})"
        if not all(math.isfinite(v) for v in step.values()):
            return f"prefetch runs inline: the trial had no timed steps in one mode ({measured})"
        if busy >= _BUSY:
            return f"prefetch runs inline: the reads' CPU fills the cores ({measured})"
        return f"prefetch runs inline: running it ahead is not faster ({measured})"
