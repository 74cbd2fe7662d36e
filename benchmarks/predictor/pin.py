"""Which input_dist schedule to pin, from a prediction: `schedule_to_pin(model, batch)` returns a
`Pin`, whose `schedule` is a value of `input_dist_schedule=` for one pipeline class.

The rule (`pin_rule`): pin the schedule predicted fastest where every other is predicted more than
`noise` slower; where the prediction cannot tell the fastest ones apart, or cannot predict at all,
keep the default, "adaptive", which decides from the job's own steps. The ranks average their
predictions first, so that every rank pins the same schedule (ranks on different schedules would
wait for each other's all-to-alls in a different order).

A tool, not part of the training path: the caller decides to run it (it probes the link over the
default process group and averages the predictions over it, collectives every rank must issue at
the same point, and may measure the machine's costs in subprocesses: `benchmarks.predictor.machine`),
and passes what it returns to the pipeline.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.predictor.api import predict
from benchmarks.predictor.link import Link, probe_link
from benchmarks.predictor.machine import machine_costs
from pipeline.stages.schedule import SCHEDULES

__all__ = ["NOISE", "Pin", "agreed_pin", "pin_rule", "schedule_to_pin"]

NOISE = 0.05
"""Schedules predicted within this fraction of the fastest are told apart only by running them."""
DEFAULT = "adaptive"
"""What to pass where no schedule is predicted surely fastest: the default, which watches the steps."""

_LINKS: dict[int, Link] = {}
"""The default group's link by world size, probed once per process."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Pin:
    """What to pass as `input_dist_schedule=`, and why. `str()` says both."""

    schedule: str
    """A schedule of `pipeline.stages.schedule.SCHEDULES`, or "adaptive" (the default)."""
    reason: str
    predicted_ms: dict[str, float]
    """Each schedule's predicted step in ms, averaged over the ranks (empty: no prediction)."""

    def __str__(self) -> str:
        return f"input_dist_schedule={self.schedule!r}: {self.reason}"


def pin_rule(predicted_ms: dict[str, float] | None, *, noise: float = NOISE) -> Pin:
    """The schedule to pin from `predicted_ms` (a predicted step per schedule; None: no prediction).

    Returns:
        The fastest schedule where every other is predicted more than `noise` slower; else
        "adaptive", as where a schedule is missing or a figure is not finite and positive.
    """
    figures = {s: float((predicted_ms or {}).get(s, math.nan)) for s in SCHEDULES}
    if not all(math.isfinite(v) and v > 0 for v in figures.values()):
        return Pin(
            schedule=DEFAULT, reason="no prediction of every schedule: the default decides", predicted_ms={}
        )
    order = sorted(figures, key=figures.__getitem__)
    best, runner_up = order[0], order[1]
    shown = ", ".join(f"{s} {figures[s]:.1f} ms" for s in order)
    gap = figures[runner_up] / figures[best] - 1
    if gap > noise:
        reason = f"{best} predicted fastest, {gap:.0%} ahead of the next, {runner_up} ({shown})"
        return Pin(schedule=best, reason=reason, predicted_ms=figures)
    close = ", ".join(s for s in order if figures[s] <= figures[best] * (1 + noise))
    reason = (
        f"{close} predicted within the noise ({noise:.0%}) of each other: the default decides from the "
        f"job's steps ({shown})"
    )
    return Pin(schedule=DEFAULT, reason=reason, predicted_ms=figures)


def agreed_pin(
    predicted_ms: dict[str, float] | None,
    *,
    noise: float = NOISE,
    agree: Callable[[list[float]], list[float]] | None = None,
) -> Pin:
    """`pin_rule` on every schedule's figure averaged over the ranks (`agree` sums a list over them;
    default: an all_reduce over the default process group), so that every rank pins alike; a rank
    without a figure makes it NaN everywhere (then every rank keeps the default)."""
    names = list(SCHEDULES)
    *summed, ranks = (agree or _all_reduce_sum)(
        [float((predicted_ms or {}).get(s, math.nan)) for s in names] + [1.0]
    )
    return pin_rule({s: v / ranks for s, v in zip(names, summed, strict=True)}, noise=noise)


def schedule_to_pin(
    model: nn.Module, batch: Any, *, pipeline: str = "sparse-dist", noise: float = NOISE
) -> Pin:
    """The schedule to pin for `pipeline` ("sparse-dist", "prefetch", "fused" or "semi-sync") on
    `model` and batches like `batch` (`agreed_pin` of its prediction).

    A collective call at more than one rank: every rank must call it at the same point.
    """
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    link = _LINKS.get(world)
    if link is None and world > 1:
        link = _LINKS[world] = probe_link(cpu_per_byte=0.0, call=0.0, budget_s=1.0, max_bytes=4 << 20)
    try:
        machine = machine_costs()
        link = (
            dataclasses.replace(link, cpu_per_byte=machine.loopback.cpu_per_byte)
            if link
            else machine.loopback
        )
        predicted = predict(model, batch, link=link, machine=machine, pipelines=(pipeline,)).schedule_ms(
            pipeline
        )
    except Exception:  # no prediction on this rank: every rank keeps the default
        predicted = None
    return agreed_pin(predicted, noise=noise)


def _all_reduce_sum(values: list[float]) -> list[float]:
    """`values` summed over the ranks of the default process group (as they are at one rank)."""
    if not (dist.is_available() and dist.is_initialized()):
        return values
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()
