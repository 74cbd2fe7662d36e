"""Each pipeline class's step as tasks for the simulator: which stage of which batch runs on which
lane, after what (`program`), and the step time, critical stage and memory that follow (`run_pipeline`).

The order of the tasks on the caller's thread is the class's `_step` (pipeline/pipelines/*.py), read
top to bottom, and the batch each stage works on is the table in `pipeline.stages`. Collectives run
on a process group's queue, in the order they were issued: torchrec's group ("world", also DDP's)
or the input all-to-alls' own ("own", under the "early" and "late-own" schedules). A blocking
collective is issued by one task and waited for by the next on the same thread.

Simplifications (docs/benchmarks.md, "Predicting a pipeline's step"): the dense forward is one task
after the pooled embeddings arrive (the part of it that could overlap them is not split out); the
backward is dense backward, the embeddings' gradient all-to-all, their backward, then DDP's
all-reduce, waited for at its end; every rank is the busiest rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.predictor.costs import Collective, StageCosts
from benchmarks.predictor.simulate import Key, Task, attribute, simulate
from pipeline.stages.schedule import SCHEDULES

__all__ = ["PIPELINES", "Outcome", "program", "run_pipeline"]

PIPELINES = ("base", "sparse-dist", "prefetch", "fused", "semi-sync")
"""The pipeline classes the simulator knows (Base, SparseDist, Prefetch, Fused, SemiSync)."""
_BATCHES_IN_FLIGHT = {"base": 2, "sparse-dist": 3, "prefetch": 3, "fused": 3, "semi-sync": 4}
_STEPS, _SKIP = 12, 5


@dataclass(frozen=True, kw_only=True, slots=True)
class Outcome:
    """What the simulation of one pipeline under one schedule says."""

    step: float
    """Seconds per step in the steady state."""
    critical: str
    """The stage the caller's thread spends most of the step on, running it or waiting for it."""
    shares: dict[str, float]
    """Seconds per step of each stage on the caller's thread (running or waited for)."""
    batches: int
    """Batches in flight (the one computing included)."""
    inflight_bytes: float
    """Bytes those batches hold: the input batches, received ids and looked-up embeddings ahead."""


class _Builder:
    def __init__(self, costs: StageCosts, group: str, *, prefetch_stage: bool = False) -> None:
        self.c, self.group, self.tasks = costs, group, []
        self.prefetch_stage = prefetch_stage
        """The Prefetch class: the cache fill is a stage of its own (else part of the lookup)."""

    def host(self, name: str, batch: int, seconds: float, *after: Key, stage: str = "") -> Key:
        self.tasks.append(Task((name, batch), "host", seconds, after=after, stage=stage))
        return (name, batch)

    def collective(self, name: str, batch: int, c: Collective, lane: str, issuer: Key) -> Key:
        latency = (("cpu", c.latency_cpu),)
        self.tasks.append(
            Task((f"{name}:latency", batch), lane, c.latency, uses=latency, after=(issuer,), stage=name)
        )
        uses = (("link", 1.0), ("cpu", self.c.cpu_share))
        self.tasks.append(Task((name, batch), lane, c.wire, uses=uses, after=((f"{name}:latency", batch),)))
        return (name, batch)

    # the stages, by the names of the classes' steps
    def copy(self, j: int) -> None:
        issued = self.host("copy", j, self.c.copy)
        if self.c.copy_device > 0:  # CUDA: the transfer on the memcpy stream
            self.tasks.append(
                Task(("h2d", j), "memcpy", self.c.copy_device, uses=(), after=(issued,), stage="copy")
            )

    def start(self, j: int) -> None:
        copied = (("h2d", j),) if self.c.copy_device > 0 else ()
        issued = self.host("input_dist::start", j, self.c.start, *copied)
        self.collective("splits a2a", j, self.c.splits, self.group, issued)

    def wait_splits(self, j: int) -> None:
        issued = self.host("input_dist::splits", j, self.c.splits_host, ("splits a2a", j))
        self.collective("values a2a", j, self.c.values, self.group, issued)

    def lookup(self, j: int) -> Key:
        """Assembly and lookup of batch j (its cache fill too, unless a prefetch stage did it);
        issues its output all-to-all (not waited for)."""
        if self.prefetch_stage:
            self.host("input_dist::wait", j, 0.0, ("prefetch", j), stage="prefetch")
            issued = self.host("lookup fwd", j, self.c.lookup_fwd + self.c.output_fwd.host)
        else:
            self.host("input_dist::wait", j, self.c.wait, ("values a2a", j))
            issued = self.host("lookup fwd", j, self.c.lookup_fwd + self.c.prefetch + self.c.output_fwd.host)
        return self.collective("output a2a", j, self.c.output_fwd, "world", issued)

    def prefetch(self, j: int, *after: Key) -> None:
        """The prefetch stage of batch j on its own stream or worker: the assembly, then the cache
        fill, once its values arrived (and after `after`: where the class submits it)."""
        self.tasks.append(
            Task(
                ("prefetch", j), "prefetch", self.c.wait + self.c.prefetch, after=(("values a2a", j), *after)
            )
        )

    def forward(self, i: int) -> None:
        self.host("dense fwd", i, self.c.dense_fwd, ("output a2a", i))

    def overhead(self, i: int) -> None:
        self.host("step overhead", i, self.c.overhead)

    def backward_and_step(self, i: int) -> None:
        issued = self.host("dense bwd", i, self.c.dense_bwd + self.c.output_bwd.host)
        self.collective("output a2a bwd", i, self.c.output_bwd, "world", issued)
        self.host("lookup bwd", i, self.c.lookup_bwd, ("output a2a bwd", i))
        issued = self.host("ddp", i, self.c.allreduce.host, stage="dense bwd")
        self.collective("all-reduce", i, self.c.allreduce, "world", issued)
        self.host("optimizer", i, self.c.optimizer, ("all-reduce", i))


def program(pipeline: str, schedule: str, costs: StageCosts, steps: int = _STEPS) -> list[Task]:
    """The tasks of `steps` steps of `pipeline` ("base", "sparse-dist", "prefetch", "fused",
    "semi-sync") under input_dist `schedule` (ignored by "base"), after the class's fill."""
    if pipeline not in PIPELINES:
        raise ValueError(f"unknown pipeline {pipeline!r}; choose from {', '.join(PIPELINES)}")
    s = SCHEDULES[schedule]
    # a prefetch stage with no cache to fill runs inline, where forward would wait (prefetch.py)
    worker = pipeline == "prefetch" and costs.prefetch > 0
    b = _Builder(costs, "own" if s.own_group else "world", prefetch_stage=worker)
    early = s.early_splits
    if pipeline == "base":
        b.group = "world"
        b.copy(0)
        for i in range(steps):
            b.overhead(i)
            b.copy(i + 1)  # overlaps compute of i (on CUDA; on CPU it is inline)
            b.start(i)
            b.wait_splits(i)
            b.lookup(i)
            b.forward(i)
            b.backward_and_step(i)
        return b.tasks
    ahead = 2 if pipeline == "semi-sync" else 1
    for j in range(ahead + 1):  # the fill: batches up to i+ahead copied, started, splits waited
        b.copy(j)
        if j < ahead:
            b.start(j)
            b.wait_splits(j)
    if pipeline in ("fused", "semi-sync"):
        b.lookup(0)
    if worker:
        b.prefetch(0)
    for i in range(steps):
        b.overhead(i)
        nxt = i + ahead
        if pipeline == "fused" and i > 0:
            b.lookup(i)  # first in the step, before the next batch's input_dist
        b.copy(nxt + 1)
        b.start(nxt)
        if early:
            b.wait_splits(nxt)
            if worker:
                b.prefetch(nxt, ("input_dist::splits", nxt))  # on the worker from here on
        if pipeline in ("sparse-dist", "prefetch"):
            b.lookup(i)
        b.forward(i)
        if pipeline == "semi-sync":
            b.lookup(i + 1)  # before backward of i: embeddings one step stale
        if not early:
            b.wait_splits(nxt)
            if worker:
                b.prefetch(nxt, ("dense fwd", i))  # prefetch_ahead: beside backward of i
        b.backward_and_step(i)
    return b.tasks


def run_pipeline(pipeline: str, schedule: str, costs: StageCosts, *, cores: float) -> Outcome:
    """Simulate `pipeline` under `schedule` with `cores` cores for this rank (its compute thread
    and gloo's threads share them) and report the steady-state step."""
    run = simulate(program(pipeline, schedule, costs), {"cpu": cores, "link": 1.0})
    begin, end = run.end[("optimizer", _SKIP)], run.end[("optimizer", _STEPS - 1)]
    steps = _STEPS - 1 - _SKIP
    shares = {k: v / steps for k, v in attribute(run, "host", begin, end).items()}
    batches = _BATCHES_IN_FLIGHT[pipeline]
    ahead = batches - 2  # batches whose ids are received before their step
    pooled_ahead = 1 if pipeline == "semi-sync" else 0
    return Outcome(
        step=(end - begin) / steps,
        critical=max(shares, key=shares.get, default="-"),
        shares=dict(sorted(shares.items(), key=lambda kv: -kv[1])),
        batches=batches,
        inflight_bytes=batches * costs.batch_bytes
        + ahead * costs.values_bytes
        + pooled_ahead * costs.pooled_bytes,
    )
