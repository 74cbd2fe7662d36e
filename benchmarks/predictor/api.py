"""`predict(model, sample_batch, ...)`: each pipeline's predicted step under each input_dist
schedule, the stage that bounds it and the memory it keeps in flight, and the winner (`Prediction`).

`predict_workload` does the same from a `Workload` and measured costs, without a model: the
benchmark CLI uses it to sweep world sizes, links and model sizes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch import nn

from benchmarks.predictor.costs import stage_costs
from benchmarks.predictor.dense import DenseTimes, time_dense
from benchmarks.predictor.link import Link, parse_link, probe_link
from benchmarks.predictor.machine import MachineCosts, machine_costs
from benchmarks.predictor.planner import gpu_lookup
from benchmarks.predictor.programs import PIPELINES, run_pipeline
from benchmarks.predictor.workload import Workload, workload_of
from pipeline.stages.schedule import SCHEDULES

__all__ = ["PipelineStep", "Prediction", "predict", "predict_workload"]

_CLASSES = {
    "base": "TrainPipelineBase",
    "sparse-dist": "TrainPipelineSparseDist",
    "prefetch": "PrefetchTrainPipelineSparseDist",
    "fused": "TrainPipelineFusedSparseDist",
    "semi-sync": "TrainPipelineSemiSync",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineStep:
    """The predicted step of one pipeline under one input_dist schedule."""

    pipeline: str
    """"base", "sparse-dist", "prefetch", "fused" or "semi-sync"."""
    schedule: str | None
    """The input_dist schedule (None for Base, which has none)."""
    step_ms: float
    critical: str
    """The stage the training thread spends most of the step on, running it or waiting for it."""
    shares_ms: dict[str, float]
    """Milliseconds per step of each stage on the training thread."""
    batches: int
    """Batches in flight."""
    inflight_bytes: float
    """Bytes those batches hold (inputs, received ids and embeddings looked up ahead)."""

    @property
    def name(self) -> str:
        return self.pipeline if self.schedule is None else f"{self.pipeline}@{self.schedule}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Prediction:
    """Predicted steps at one world size over one link. `str()` is a table."""

    world_size: int
    batch_size: int
    link: str
    steps: tuple[PipelineStep, ...]
    notes: tuple[str, ...] = field(default=())
    """What was assumed where a fact could not be read or measured."""

    @property
    def winner(self) -> PipelineStep:
        """The fastest pipeline and schedule; of those within 0.5 % of it, the first in `steps`
        (the simpler class: Base, SparseDist, Prefetch, Fused, SemiSync)."""
        fastest = min(s.step_ms for s in self.steps)
        return next(s for s in self.steps if s.step_ms <= fastest * 1.005)

    def best(self, pipeline: str) -> PipelineStep:
        """`pipeline`'s fastest schedule."""
        return min((s for s in self.steps if s.pipeline == pipeline), key=lambda s: s.step_ms)

    def schedule_ms(self, pipeline: str) -> dict[str, float]:
        """`pipeline`'s predicted step per schedule, in ms (what `benchmarks.predictor.pin` pins from)."""
        return {s.schedule: s.step_ms for s in self.steps if s.pipeline == pipeline and s.schedule}

    def __str__(self) -> str:
        head = f"predicted step, {self.world_size} ranks x {self.batch_size} samples, link {self.link}"
        rows = [
            f"{'pipeline':<24} {'step ms':>9} {'vs best':>8} {'batches':>8} {'in flight':>10}  critical stage"
        ]
        best = self.winner.step_ms
        for s in sorted(self.steps, key=lambda s: s.step_ms):
            rows.append(
                f"{s.name:<24} {s.step_ms:>9.2f} {s.step_ms / best:>7.2f}x {s.batches:>8} "
                f"{s.inflight_bytes / 2**20:>6.1f} MiB  {s.critical}"
            )
        w = self.winner
        rows.append(
            f"winner: {_CLASSES[w.pipeline]}"
            + (f" with input_dist_schedule={w.schedule!r}" if w.schedule else "")
        )
        return "\n".join([head, *rows, *(f"note: {n}" for n in self.notes)])


def predict(
    model: nn.Module,
    sample_batch: Any,
    *,
    world_size: int | None = None,
    link: str | Link = "probe",
    batch_size: int | None = None,
    cores_per_rank: float | None = None,
    pipelines: Sequence[str] = PIPELINES,
    machine: MachineCosts | None = None,
) -> Prediction:
    """Predict each pipeline's step for `model` on batches like `sample_batch`.

    Args:
        model: a DistributedModelParallel (its plan says where the tables are).
        sample_batch: one batch as this rank's dataloader yields it.
        world_size: ranks to predict for (default: the current world size); the tables are placed
            again on that many ranks (`Workload.at_world_size`).
        link: "probe" measures the current process group (a collective call: every rank must call
            `predict` at the same point; at one rank it falls back to "loopback"); or a link name
            ("loopback", "1gbit", "25gbit:10us"; `benchmarks.predictor.parse_link`), or a `Link`.
        batch_size: samples per rank to predict for (default: the sample batch's).
        cores_per_rank: cores each rank's threads share (default: this machine's cores over
            `$LOCAL_WORLD_SIZE`).
        pipelines: which of "base", "sparse-dist", "prefetch", "fused", "semi-sync" to predict.
        machine: this machine's costs (default: `machine_costs()`, measured once and cached).

    Returns:
        A `Prediction`; `str()` of it is a table, `.winner` the fastest.

    Raises:
        ValueError: the model has no sharded module, the batch no KeyedJaggedTensor, or a name
            is unknown.
    """
    machine = machine or machine_costs()
    workload = workload_of(model, sample_batch)
    notes = list(workload.notes)
    if isinstance(link, str) and link == "probe":
        if dist.is_initialized() and dist.get_world_size() > 1:
            link = probe_link(cpu_per_byte=machine.loopback.cpu_per_byte, call=machine.a2a_call)
        else:
            notes.append("one rank: no link to probe, the loopback's assumed")
            link = machine.loopback
    dense = time_dense(model, sample_batch)
    if dense is None:
        notes.append("the dense part could not be timed on the model: estimated from micro-benchmarks")
    workload = workload.at_world_size(world_size or workload.world_size, batch_size=batch_size)
    cores = cores_per_rank or (os.cpu_count() or 1) / max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return predict_workload(
        workload, machine, link, dense=dense, cores_per_rank=cores, pipelines=pipelines, notes=notes
    )


def predict_workload(
    workload: Workload,
    machine: MachineCosts,
    link: str | Link,
    *,
    dense: DenseTimes | None = None,
    dense_batch_size: int | None = None,
    cores_per_rank: float = 1.0,
    pipelines: Sequence[str] = PIPELINES,
    notes: Sequence[str] = (),
) -> Prediction:
    """`predict` from a `Workload` and measured costs.

    Args:
        dense: the dense part's times, measured at `dense_batch_size` samples (default: the
            workload's); scaled to the workload's batch size.
    """
    if isinstance(link, str):
        link = parse_link(link, loopback=machine.loopback)
    unknown = set(pipelines) - set(PIPELINES)
    if unknown:
        raise ValueError(f"unknown pipelines {sorted(unknown)}; choose from {', '.join(PIPELINES)}")
    if machine.load > 0.5:  # machine_costs() measures again once the machine is quiet
        notes = [
            *notes,
            f"this machine's costs were measured under a load of {machine.load:.1f} per core: "
            "measure them again on a quiet machine (machine_costs(refresh=True))",
        ]
    if dense is not None and dense_batch_size and dense_batch_size != workload.batch_size:
        scale = workload.batch_size / dense_batch_size
        dense = DenseTimes(forward=dense.forward * scale, backward=dense.backward * scale)
    gpu = gpu_lookup(workload) if workload.device == "cuda" else None
    costs = stage_costs(workload, machine, link, dense=dense, gpu_lookup=gpu)
    steps = []
    for pipeline in pipelines:
        for schedule in (None,) if pipeline == "base" else tuple(SCHEDULES):
            out = run_pipeline(pipeline, schedule or "late", costs, cores=cores_per_rank)
            steps.append(
                PipelineStep(
                    pipeline=pipeline,
                    schedule=schedule,
                    step_ms=out.step * 1e3,
                    critical=out.critical,
                    shares_ms={k: v * 1e3 for k, v in out.shares.items()},
                    batches=out.batches,
                    inflight_bytes=out.inflight_bytes,
                )
            )
    return Prediction(
        world_size=workload.world_size,
        batch_size=workload.batch_size,
        link=link.name,
        steps=tuple(steps),
        notes=tuple(notes),
    )
