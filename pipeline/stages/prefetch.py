"""`PrefetchStage`, a batch's prefetch stage: its input_dist waited, then each sharded module's
`prefetch()`, on the prefetch stream (a worker thread on CPU); and `PrefetchWatch`, Prefetch's
ahead-or-inline choice on CPU under `prefetch_ahead="auto"`, by the rule of `pipeline.stages.watch`
(docs/tiered.md, "Ahead or inline")."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from pipeline.stages.context import PrefetchBatchContext
from pipeline.stages.streams import Streams, label, run_stage
from pipeline.stages.watch import FINAL, StepWatch, WatchPhase

if TYPE_CHECKING:
    from pipeline.stages.input_dist import InputDist

__all__ = ["PrefetchStage", "PrefetchWatch", "prefetch_does_work"]


class PrefetchWatch(StepWatch):
    """Whether the prefetch stage runs "inline" (from the start) or "ahead" (once verified faster);
    `StepWatch`'s settings and defaults, but the threshold: 0.2."""

    modes: ClassVar[tuple[str, str]] = ("inline", "ahead")
    label: ClassVar[str] = "prefetch"

    def __init__(self, *, threshold: float = 0.2, **settings: Any) -> None:
        super().__init__(threshold=threshold, **settings)
        self.blocked = 0.0
        """Seconds the training thread blocked in the prefetch stage since the last step."""
        self.alone_reason: str | None = None

    @property
    def clocked(self) -> bool:
        """Whether the prefetch stage's wait is timed (while the watch watches or tries)."""
        return self.phase not in FINAL

    def _parts(self) -> tuple[float]:
        blocked, self.blocked = self.blocked, 0.0
        return (blocked,)

    def no_ride(self, reason: str) -> None:
        """Nothing rides: each rank decides from its own steps (the mode changes where the work
        runs, not what it computes, so ranks that decide apart still train alike)."""
        if self.phase not in FINAL and not self.alone:
            self.alone, self.alone_reason = True, reason

    def _switched_text(self, share: float, clear: bool) -> str:
        return (
            f"the training thread blocked in the prefetch stage {share:.0%} of the step inline (median "
            f"over {self.window} steps, mean over {len(self.shares)} rank(s): {self._shares_text()}; "
            f"observed from step {self.ready_at}, once the caches were full; {self._held_text(clear)}): "
            f"trying it ahead on its worker thread from the next step, verified over {self._verified_text()}"
        )

    def _verdict_head(self, *, kept: bool) -> str:
        runs = "ahead on its worker thread" if kept else "inline again from the next step"
        return f"prefetch runs {runs}: the step ahead over the step inline"

    def _pinned_text(self, reason: str) -> str:
        return f"prefetch runs inline: {reason}"

    def __repr__(self) -> str:
        head = f"prefetch: auto, running {self.mode}"
        if self.alone_reason is not None:
            head += f"; each rank decides alone ({self.alone_reason})"
        if self.phase is WatchPhase.WATCHING and self.ready_at is None:
            return f"{head}; waiting for the caches to fill before watching"
        return self._described(head, "the training thread blocks in the prefetch stage", "figures", "ahead")


class PrefetchStage:
    """The prefetch stage of a batch: wait for its input_dist, then each module's `prefetch()`.
    `ahead`: `PrefetchOptions.prefetch_ahead` ("auto": ahead on CUDA; on CPU inline, until `watch`, a
    `PrefetchWatch` by default, moves it ahead)."""

    def __init__(
        self,
        streams: Streams,
        input_dist: InputDist,
        *,
        ahead: bool | str,
        watch: PrefetchWatch | None = None,
    ) -> None:
        self._streams, self._input_dist = streams, input_dist
        auto = ahead == "auto" and streams.has_prefetch_worker
        self.ahead = (not auto) if ahead == "auto" else ahead
        self.watch: PrefetchWatch | None = (watch or PrefetchWatch()) if auto else None
        """Under "auto" on CPU: the watch that may run the stage ahead."""
        if self.watch is not None:
            input_dist.add_watch(self.watch)
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
        if not self._working:
            self.stay_inline()
        elif self.watch is not None:
            caches = [
                m
                for pm in modules
                if pm.fqn in self._working
                for m in pm.module.modules()
                if callable(getattr(m, "caches_full", None))
            ]
            if caches:
                self.watch.ready = lambda: all(m.caches_full() for m in caches)

    def stay_inline(self) -> None:
        """The stage will not run (no module's `prefetch()` moves data): nothing ahead, no thread."""
        if self.watch is not None and self.watch.choice is None:
            self.watch.pin("no sharded module's prefetch() moves data")
        self.ahead = False
        self._streams.set_prefetch_on_worker(False)

    def submit_early(self, ctx: PrefetchBatchContext) -> None:
        """Under `ahead` on a worker thread: submit `ctx`'s prefetch before forward of the batch before it."""
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
        """Before forward of `ctx`: its prefetch stage done (submitted now if it was not). While the
        watch watches or tries, the time the training thread blocks here is its figure."""
        watch = self.watch
        start = watch.clock() if watch is not None and watch.clocked else None
        self.submit(ctx)  # not ahead, the first batch, or another lane's successor
        ctx.prefetch_job.result()  # re-raises what went wrong on the prefetch stream
        if start is not None:
            watch.blocked += watch.clock() - start

    def start_step(self, training: bool) -> None:
        """At a step's start: under the watch, run this training step's stage ahead or inline as it says."""
        watch = self.watch
        if watch is None:
            return
        if not training:
            watch.interrupt()
            return
        ahead = watch.step() == "ahead"
        if ahead != self.ahead:
            self.ahead = ahead
            self._streams.set_prefetch_on_worker(ahead)

    def _run(self, ctx: PrefetchBatchContext, forward_stream: Any) -> None:
        streams = self._streams
        self._input_dist.release_inputs(ctx)
        with run_stage(streams, "prefetch", ctx.index), torch.no_grad():
            for site in self._input_dist.sites:
                prepared = ctx.take_input_dist(site.key)
                if prepared is None:
                    continue
                module_ctx, data = prepared
                if site.fqn in self._working:
                    # fbgemm's UVM-caching kernels record their cache locations on forward_stream
                    # themselves (record_stream inside `prefetch`); what we hand over is held by ctx
                    with label(f"pipeline::prefetch::{site.key}#{ctx.index}"):
                        site.module.prefetch(dist_input=data, forward_stream=forward_stream, ctx=module_ctx)
                streams.produced(data)
                streams.produced(module_ctx)
                ctx.prefetched[site.key] = (module_ctx, data)


_NO_PREFETCH = frozenset({"dense", "fused", "fused_uvm", "quant", "quant_uvm"})
"""torchrec compute kernels whose `prefetch()` moves nothing (tables wholly in device or UVM memory)."""


def prefetch_does_work(module: Any) -> bool:
    """Whether `module.prefetch()` can move data: some table is on a kernel with a cache to fill
    (UVM caching, key-value, SSD/DRAM virtual tables, a custom one such as `tiered/`); without a plan, yes."""
    plan = getattr(module, "module_sharding_plan", None)
    if not isinstance(plan, dict) or not plan:
        return True
    return any(getattr(p, "compute_kernel", None) not in _NO_PREFETCH for p in plan.values())
