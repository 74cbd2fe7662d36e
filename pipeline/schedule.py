"""When the next batch's input all-to-alls run: the "early" and "late" schedules, and the "auto"
choice between them.

- "early": the splits of batch i+1 are waited for right after they are launched, before forward of
  batch i, so its values all-to-all is under way during forward, backward and the optimizer step of
  i; it runs on a process group of its own (`rewrite.InputDistGroups`), so backward's collectives do
  not queue behind it. Best when input_dist moves a lot of data over a slow link.
- "late": torchrec's order and group: the splits are waited for after forward of i. No blocking round
  trip before forward and no extra communicator: best when input_dist is small and latency-bound.
- "auto": `Tuner` times both over the first training steps and keeps the faster, on every rank.

Numerics are the same under every schedule: only when the (identical) data moves changes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["SCHEDULES", "Tuner"]

SCHEDULES = ("auto", "early", "late")


class Tuner:
    """Runs blocks of `block` training steps alternately under "early" and "late" after `warmup`
    steps, `rounds` blocks each, then keeps the schedule with the lower median step time.

    A step's time is from the start of one `progress()` to the start of the next, so whatever the
    caller does between steps counts as it does in real training. The ranks agree by summing their
    medians with one all_reduce, so all of them switch to the same schedule at the same step.

    Args:
        warmup: steps before timing starts (first-batch costs: input dist creation, fx trace).
        block: consecutive steps under one schedule; the first of each block is not timed (it
            carries the switch).
        rounds: blocks per schedule.
        clock: seconds, monotonic (tests inject a fake one).
        agree: sums a list of floats over the ranks (tests inject one without a process group).
    """

    def __init__(
        self,
        *,
        warmup: int = 3,
        block: int = 4,
        rounds: int = 2,
        clock: Callable[[], float] = time.perf_counter,
        agree: Callable[[list[float]], list[float]] | None = None,
    ) -> None:
        self._plan = ["early"] * warmup
        for _ in range(rounds):
            self._plan += ["early"] * block + ["late"] * block
        self._block = block
        self._warmup = warmup
        self._clock = clock
        self._agree = agree or _all_reduce_sum
        self._times: dict[str, list[float]] = {"early": [], "late": []}
        self._steps = 0
        self._last: tuple[float, str, bool] | None = None
        self.choice: str | None = None
        """The schedule kept, once decided."""
        self.medians_ms: dict[str, float] = {}
        """Median step time of each schedule, summed over ranks, in ms (once decided)."""

    def next_schedule(self) -> str:
        """Called at the start of each training step; the schedule to run it under."""
        now = self._clock()
        if self._last is not None:
            started, schedule, timed = self._last
            if timed:
                self._times[schedule].append(now - started)
            self._last = None
        if self.choice is not None:
            return self.choice
        if self._steps == len(self._plan):
            self._decide()
            return self.choice
        schedule = self._plan[self._steps]
        position = self._steps - self._warmup
        timed = position >= 0 and position % self._block != 0
        self._last = (now, schedule, timed)
        self._steps += 1
        return schedule

    def interrupt(self) -> None:
        """A step ended abnormally (or an eval step ran between): do not time across it."""
        self._last = None

    def _decide(self) -> None:
        early, late = self._agree([_median(self._times["early"]), _median(self._times["late"])])
        self.medians_ms = {"early": early * 1e3, "late": late * 1e3}
        self.choice = "early" if early <= late else "late"


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("inf")


def _all_reduce_sum(values: list[float]) -> list[float]:
    if not (dist.is_available() and dist.is_initialized()):
        return values
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()
