"""`PrefetchStage`: the prefetch stage of a batch, waiting for its input_dist and running each
sharded module's `prefetch()` on the prefetch stream (a worker thread on CPU), ahead of forward where
that pays (`pipeline.stages.overlap`)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from pipeline.stages.context import PrefetchBatchContext
from pipeline.stages.input_dist import InputDist
from pipeline.stages.labels import label, run_stage
from pipeline.stages.overlap import OverlapTrial
from pipeline.stages.streams import Streams

__all__ = ["PrefetchStage", "prefetch_does_work"]


class PrefetchStage:
    """The prefetch stage of a batch: wait for its input_dist, then each module's `prefetch()`,
    on the prefetch stream (a worker thread on CPU).

    Args:
        streams: the pipeline's streams.
        input_dist: the pipeline's input_dist (its modules, and `clear_data_dist_inputs`).
        ahead: `PrefetchOptions.prefetch_ahead`: True, False or "auto". On CPU, "auto" runs the
            stage inline where the modules' `prefetch()` calls take under `AHEAD_MIN_MS` a batch
            (median of batches 2 to 9: handing a near-empty stage to a thread costs more than it
            hides), and otherwise lets `trial` measure whether running it ahead pays.
        trial: under "auto" on CPU, the `OverlapTrial` that decides (None: `OverlapTrial()`).
    """

    AHEAD_MIN_MS = 1.0
    """Under "auto" on CPU, the prefetch work per batch below which the stage stays inline."""
    _AHEAD_SAMPLES = 8

    def __init__(
        self, streams: Streams, input_dist: InputDist, *, ahead: bool | str, trial: OverlapTrial | None = None
    ) -> None:
        self._streams, self._input_dist = streams, input_dist
        self.ahead = ahead if ahead != "auto" else True
        self._auto = ahead == "auto" and streams.has_prefetch_worker
        self.trial: OverlapTrial | None = None
        """Under "auto" on CPU, once the stage has work: the trial deciding ahead or inline."""
        self._next_trial = (trial or OverlapTrial()) if self._auto else None
        self._work_ms: list[float] = []  # prefetch() time per batch, for the "auto" choice
        self._working: set[str] | None = None
        """FQNs of the modules whose `prefetch()` moves data (known at the first submission)."""
        streams.set_prefetch_on_worker(self.ahead)

    def _find_work(self) -> None:
        """Once the modules are rewritten: which `prefetch()` calls do work. With none (torchrec's
        fused kernels), the stage only waits for input_dist, inline: no thread hand-off, no call."""
        modules = self._input_dist.modules
        self._working = {pm.fqn for pm in modules if prefetch_does_work(pm.module)}
        idle = [pm.fqn for pm in modules if pm.fqn not in self._working]
        if idle and self._input_dist.report is not None:
            self._input_dist.report.notes.append(
                f"prefetch() of {', '.join(idle)} moves no data (kernels without a cache to fill): "
                "not called" + ("; the prefetch stage runs inline" if not self._working else "")
            )
        if not self._working and self._auto:
            self._auto, self.ahead = False, False
            self._streams.set_prefetch_on_worker(False)

    def stay_inline(self) -> None:
        """The stage will not run (no module's `prefetch()` moves data): nothing ahead, no thread."""
        self._auto, self.ahead = False, False
        self._streams.set_prefetch_on_worker(False)

    def submit_early(self, ctx: PrefetchBatchContext) -> None:
        """Submit `ctx`'s prefetch before forward of the batch before it, where that runs on a
        worker thread (under `ahead`)."""
        if self.ahead and self._streams.prefetch_on_worker:
            self.submit(ctx)

    def submit(self, ctx: PrefetchBatchContext, forward_stream: Any = None) -> None:
        """Submit `ctx`'s prefetch stage (once). `forward_stream`: where its forward will run, if
        not on the stream current here."""
        if self._working is None:
            self._find_work()
        if ctx.prefetch_job is None:
            if forward_stream is None:
                forward_stream = self._streams.current()
            ctx.prefetch_job = self._streams.submit(
                self._streams.prefetch, lambda: self._run(ctx, forward_stream)
            )

    def wait(self, ctx: PrefetchBatchContext) -> None:
        """Before forward of `ctx`: its prefetch stage done (submitted now if it was not)."""
        self.submit(ctx)  # not ahead, the first batch, or another lane's successor
        ctx.prefetch_job.result()  # re-raises what went wrong on the prefetch stream
        if self._auto and len(self._work_ms) > self._AHEAD_SAMPLES:
            self._auto = False
            self.ahead = statistics.median(self._work_ms[1:]) >= self.AHEAD_MIN_MS
            self._streams.set_prefetch_on_worker(self.ahead)
            if self.ahead:
                self.trial = self._next_trial

    def start_step(self, training: bool) -> None:
        """At the start of a step: under a trial, run this training step's stage ahead or inline
        as it says (an eval step is not timed), and note each decision that changes the mode."""
        trial = self.trial
        if trial is None:
            return
        if not training:
            trial.interrupt()
            return
        previous, decided = trial.result, trial.decided_at
        tuner = self._input_dist.tuner
        ahead = trial.next_step(busy=tuner is not None and tuner.tuning)
        if ahead != self.ahead:
            self.ahead = ahead
            self._streams.set_prefetch_on_worker(ahead)
        report = self._input_dist.report
        changed = trial.decided_at != decided and (previous is None or previous.ahead != trial.result.ahead)
        if changed and report is not None:
            report.notes.append(trial.result.reason)

    def _run(self, ctx: PrefetchBatchContext, forward_stream: Any) -> None:
        streams = self._streams
        work = 0.0
        self._input_dist.release_inputs(ctx)
        with run_stage(streams, "prefetch", ctx.index), torch.no_grad():
            for site in self._input_dist.sites:
                prepared = ctx.take_input_dist(site.key)
                if prepared is None:
                    continue
                module_ctx, data = prepared
                if site.fqn in self._working:
                    start = time.perf_counter()
                    # fbgemm's UVM-caching kernels record their cache locations on forward_stream
                    # themselves (record_stream inside `prefetch`); what we hand over is held by ctx
                    with label(f"pipeline::prefetch::{site.key}#{ctx.index}"):
                        site.module.prefetch(dist_input=data, forward_stream=forward_stream, ctx=module_ctx)
                    work += time.perf_counter() - start
                streams.produced(data)
                streams.produced(module_ctx)
                ctx.prefetched[site.key] = (module_ctx, data)
        if self._auto:
            self._work_ms.append(work * 1e3)


_NO_PREFETCH = frozenset({"dense", "fused", "fused_uvm", "quant", "quant_uvm"})
"""torchrec compute kernels whose `prefetch()` moves nothing (tables wholly in device or UVM memory)."""


def prefetch_does_work(module: Any) -> bool:
    """Whether `module.prefetch()` can move data: some table of it is on a kernel with a cache to
    fill (UVM caching, key-value, SSD/DRAM virtual tables, or a custom kernel such as `tiered/`).
    A module without a sharding plan is assumed to work."""
    plan = getattr(module, "module_sharding_plan", None)
    if not isinstance(plan, dict) or not plan:
        return True
    return any(getattr(p, "compute_kernel", None) not in _NO_PREFETCH for p in plan.values())
