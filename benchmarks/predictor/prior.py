"""The prediction the "auto" input_dist tuner starts from: `schedule_prior(model, batch)`, each
schedule's predicted step for one pipeline class, to pass as `pipeline.Tuner(prior=...)`.

A tool, not part of the training path: the caller decides to run it (it probes the link over the
default process group, a collective every rank must issue at the same point, and may measure the
machine's costs in subprocesses: `benchmarks.predictor.machine`), and passes what it returns to the
pipeline. Anything that goes wrong after the probe (no cached machine costs and no way to measure
them, a model the cost model cannot read) returns None: the tuner then measures every schedule.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist
from torch import nn

from benchmarks.predictor.api import predict
from benchmarks.predictor.link import Link, probe_link
from benchmarks.predictor.machine import machine_costs

__all__ = ["schedule_prior"]

_LINKS: dict[int, Link] = {}
"""The default group's link by world size, probed once per process."""


def schedule_prior(model: nn.Module, batch: Any, *, pipeline: str = "sparse-dist") -> dict[str, float] | None:
    """Each input_dist schedule's predicted step in ms for `pipeline` ("sparse-dist", "prefetch",
    "fused" or "semi-sync") on `model` and batches like `batch`; None if it cannot predict.

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
        return predict(model, batch, link=link, machine=machine, pipelines=(pipeline,)).schedule_ms(pipeline)
    except Exception:  # no prediction: the tuner measures every schedule
        return None
