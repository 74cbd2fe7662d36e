"""`InputDist`: starts and waits the input all-to-alls of the pipelined sharded modules.

Its life: `attach` rewrites the sharded modules on the first batch (`Attachment`); `start` launches
each module's splits all-to-all for a batch (`input_dist::start`, fused into one collective per group
from the second batch on); `wait_splits` waits for them and launches the values all-to-alls
(`input_dist::splits`); the hijacked forwards take the values through the batch's context
(`input_dist::wait`); `detach` restores the model. The schedule (`pipeline.stages.schedule`) says
when the splits are waited, on which group.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch.distributed as dist
from torch import nn

from pipeline.config import InputDistOptions, RewriteOptions
from pipeline.ranks import Lane, Ranks
from pipeline.ranks.riding import Admission
from pipeline.stages.attachment import Attachment
from pipeline.stages.context import BatchContext
from pipeline.stages.groups import InputDistGroups
from pipeline.stages.memory import MemoryFlags, release_features, release_sent_inputs
from pipeline.stages.narrow import NarrowIds, every_rank, originals
from pipeline.stages.schedule import SCHEDULES
from pipeline.stages.streams import Streams, run_stage
from pipeline.stages.watch import ScheduleWatch
from pipeline.stages.watch_text import NOT_ON_NCCL, ONE_RANK, WATCH_ADVICE
from rewrite import CallSite, ContextSlot, PipelinedModule, Rewrite, RewriteReport
from rewrite.replay import fuse_splits_requests, one_by_one

__all__ = ["InputDist"]


class InputDist:
    """Input all-to-alls of every pipelined sharded module of `model`, batch by batch.

    Args:
        model: the model the pipeline runs (its sharded modules are rewritten on `attach`).
        streams: the pipeline's streams (the all-to-alls run on `data_dist`).
        rewrite: how the sharded modules' inputs are found (`RewriteOptions`).
        strict: fail on the first batch if a sharded module cannot be pipelined.
        pipeline_postproc: run parameter-free modules that transform the batch ahead.
        schedule: the input_dist schedule, its watch, and whether ids are narrowed (`InputDistOptions`).
        memory: torchrec's memory flags (`MemoryFlags`).
        forward: which hijacked forward the sharded modules get: "input_dist" (wait for the values
            all-to-all), "prefetch" or "lookup" (take that stage's output).
        carry: a batch's status may ride on its fused splits all-to-all instead of a vote of its own
            (only for pipelines that admit every batch through `fill` and `start_next`).
        ranks: the ranks' protocol: it admits each batch before its input_dist starts and creates
            the own groups (`Ranks.new_group`). None (`SparseDataDistUtil`): neither.
    """

    def __init__(
        self,
        model: nn.Module,
        streams: Streams,
        *,
        rewrite: RewriteOptions,
        strict: bool = False,
        pipeline_postproc: bool = False,
        schedule: InputDistOptions,
        memory: MemoryFlags | None = None,
        forward: str = "input_dist",
        ranks: Ranks | None = None,
        carry: bool = False,
    ) -> None:
        self._streams, self._memory = streams, memory or MemoryFlags()
        self.slot = ContextSlot()
        """Holds the context of the batch whose forward runs (the hijacked forwards read it)."""
        self._attached = Attachment(
            model,
            self.slot,
            options=rewrite,
            strict=strict,
            pipeline_postproc=pipeline_postproc,
            forward=forward,
            free_early=self._memory.free_features_storage_early,
        )
        self.watch = (schedule.watch or ScheduleWatch()) if schedule.schedule == "adaptive" else None
        """Under the default ("adaptive"): the watch that may move to "early" (`pipeline.stages.watch`)."""
        self.schedule = "late" if schedule.schedule == "adaptive" else schedule.schedule
        """The schedule in use (under "adaptive", may change once or twice: `ScheduleWatch`)."""
        self._one_rank = not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1
        """One rank: the input all-to-alls move nothing between ranks, so the splits are not fused
        into an all-to-all of their own and every schedule does the same work."""
        self.freed_bytes = 0
        """Bytes released by the memory flags so far."""
        self._ranks = ranks
        if self.watch is not None:
            self.watch.note = self._note
            if self._one_rank:
                self.watch.pin(ONE_RANK)
            elif dist.get_backend() == "nccl":
                self.watch.pin(NOT_ON_NCCL)
        self._admission = Admission(ranks, carry, watch=self.watch)
        """Whether each batch is trained: by its vote, or what rides on its splits (else pins the watch)."""
        checked = ranks.kjts.in_int32 if ranks is not None and ranks.kjts is not None else None
        self._narrow = NarrowIds(schedule.narrow_ids, self._note, one_rank=self._one_rank, proven=checked)
        """Which call sites' KJTs go through the all-to-all as int32 (`pipeline.stages.narrow`)."""
        self._others: list[Any] = []
        """Other stages' watches (`add_watch`)."""
        self._groups = InputDistGroups(ranks.new_group if ranks is not None else dist.new_group, self._note)

    @property
    def rewrite(self) -> Rewrite | None:
        """The rewrite of the sharded modules, from the first batch until `detach`."""
        return self._attached.rewrite

    @property
    def report(self) -> RewriteReport | None:
        return self._attached.report

    @property
    def modules(self) -> list[PipelinedModule]:
        """The pipelined sharded modules (none before the first batch)."""
        return self._attached.modules

    @property
    def sites(self) -> list[CallSite]:
        """Every call of a pipelined sharded module in one forward (none before the first batch)."""
        return self._attached.sites

    @property
    def early_splits(self) -> bool:
        """The schedule waits for the next batch's splits before forward."""
        return SCHEDULES[self.schedule].early_splits

    def choose_schedule(self, training: bool) -> None:
        """At the start of a step: under "adaptive", let the watch pick this training step's
        schedule (an eval step is not timed)."""
        watch = self.watch
        if watch is not None and watch.settled:  # decided for good: it only counts the step
            watch.steps += training
        elif watch is not None:
            if training:
                self.schedule = watch.step()
            else:
                watch.interrupt()

    def _note(self, text: str) -> None:
        if self.report is not None:
            self.report.notes.append(text)

    def add_watch(self, watch: Any) -> None:
        """Let another stage's watch (`pipeline.stages.prefetch_watch`) publish in the ranks' words."""
        watch.note = self._note
        self._others.append(watch)
        if self._one_rank:
            watch.no_ride("one rank")
        self._admission.add_watch(watch)

    def use_forward(self, forward: str) -> None:
        """Change which hijacked forward the sharded modules get, before the first batch (see the class)."""
        self._attached.use_forward(forward)

    def step_ended(self) -> None:
        """A step ended: the watches stop its clock (the time until the next step is not a step's)."""
        for watch in filter(None, (self.watch, *self._others)):
            if not watch.settled:
                watch.step_ended()

    def interrupt(self) -> None:
        """The step ended abnormally (the pipeline reset): no watch times across it."""
        for watch in filter(None, (self.watch, *self._others)):
            if not watch.settled:
                watch.interrupt()

    def attach(self, batch: Any) -> Rewrite:
        """Rewrite the model's sharded modules, once, with `batch` as the sample (`Attachment`)."""
        return self._attached.attach(batch)

    def recording(self, ctx: BatchContext) -> Any:
        """The context manager to run `ctx`'s forward in while the rewrite waits for a recorded one."""
        rewrite = self._attached.rewrite  # the steady step: pipelined, nothing to record
        steady = rewrite is not None and not rewrite.needs_recording
        return None if steady else self._attached.recording(ctx.batch)

    def _agree(self, rewrite: Rewrite, ctx: BatchContext) -> None:
        """Once the rewrite is complete, at `ctx`'s batch: every rank must have found the same call
        sites and have the same live watches' settings; then which sites narrow (`NarrowIds.settle`)."""
        if self._ranks is not None:
            self._ranks.agree_on("call sites of the sharded modules", rewrite.signature())
            live = [w.settings() for w in (self.watch, *self._others) if w is not None and w.publishing]
            if live:  # the watches decide from the words alike only with the same settings
                self._ranks.agree_on("watch settings", "\n".join(live), advice=WATCH_ADVICE)
        sample = partial(rewrite.site_inputs, ctx.batch, ctx.postproc_results)
        self._narrow.settle(rewrite.sites, sample, self._ranks.gather if self._ranks else every_rank)

    def detach(self) -> None:
        """Restore every original forward and process group; the next `start` re-attaches."""
        self._groups.restore()
        self._admission.forget()
        self._attached.detach()
        self.slot.current = None

    def start(self, ctx: BatchContext) -> None:
        """Launch the splits all-to-all of every pipelined call site for `ctx`'s batch (nothing while
        the rewrite waits for a recorded forward: the batch is started by a later `fill`)."""
        if ctx.started:
            return
        own = SCHEDULES[self.schedule].own_group  # their own groups, or torchrec's
        if self._admission.without_batch(ctx):  # zero splits where the others send theirs
            self._groups.place(own, self.rewrite.modules, ctx.index)
            ctx.splits_requests, ctx.started = self._admission.status_only(ctx, self._groups.current), True
            return
        if ctx.copy_job is not None:  # the device batch, its copy dispatched on a worker
            ctx.wait_copy()
        streams, rewrite = self._streams, self._attached.rewrite
        rewrite = rewrite if rewrite is not None else self.attach(ctx.batch)
        if rewrite.needs_recording:
            return
        if not self._attached.settled:
            self._attached.settle(rewrite, lambda r: self._agree(r, ctx))
        fused = not self._one_rank and (rewrite.fused or rewrite.fuse_splits())
        if fused and not self._admission.checked:  # whether statuses can ride, decided once
            why = self._admission.check([pm.module for pm in rewrite.modules])
            rewrite.report.notes += [why] if why else []
        if fused and own is not self._groups.at_rest:  # else nothing to move or retire
            self._groups.place(own, rewrite.modules, ctx.index)

        with run_stage(streams, "input_dist::start", ctx.index, streams.data_dist):
            streams.handoff(ctx.batch, streams.memcpy, ctx)
            streams.consumed(ctx.batch)
            requests, narrowed, narrow = {}, {}, self._narrow.sites
            for site, args, kwargs in rewrite.site_inputs(ctx.batch, ctx.postproc_results):
                args, kwargs = site.module.preprocess_input(args, kwargs)
                if site.key in narrow:
                    args, kwargs = self._narrow.inputs(site, args, kwargs, narrowed, ctx.index)
                module_ctx = ctx.module_contexts[site.key] = site.module.create_context()
                requests[site.key] = site.module.input_dist(module_ctx, *args, **kwargs)
            for result in ctx.postproc_results.values():
                streams.produced(result)
            if self._attached.free_early:  # every module has its own permuted copy
                self.freed_bytes += release_features(ctx.module_contexts.values(), originals(narrowed))
            if fused:
                carrier = self._admission.carrier(ctx)
                ctx.splits_requests = fuse_splits_requests(requests, ctx.module_contexts, carrier=carrier)
                self._admission.learn(ctx.splits_requests)
            else:
                ctx.splits_requests = one_by_one(requests)
        ctx.started = True
        if self.watch is not None and not self.watch.settled:
            ctx.wait_clock = self.watch.active_clock

    def wait_splits(self, ctx: BatchContext) -> bool:
        """Wait for the splits all-to-all of `ctx` and launch its values all-to-alls (a no-op once
        done). Where the batch's status rode on it, the ranks' statuses decide first (`Ranks.conclude`).

        Returns:
            False: some rank lacks the batch; it and the batches after it left the lane.
        """
        with run_stage(self._streams, "input_dist::splits", ctx.index, self._streams.data_dist):
            # The whole wait is timed: where the status rides, `conclude` is where it blocks.
            clock = ctx.wait_clock
            return self._wait_splits(ctx) if clock is None else clock.timed(self._wait_splits, ctx)

    def _wait_splits(self, ctx: BatchContext) -> bool:
        if not self._admission.conclude(ctx):
            return False
        for names, request in ctx.splits_requests:
            for name, values in zip(names, request.wait(), strict=True):
                ctx.input_dist_requests[name] = values
        ctx.splits_requests = []
        return True

    # -- the next batch, within a step (the pipelines' steps call these by name) ---------------

    def fill(self, lane: Lane, enqueue: Callable[[Lane], bool]) -> None:
        """Before a step: the head batch admitted, its input_dist started and its splits waited;
        the batch after it copied (`enqueue`)."""
        if not lane.inflight:
            enqueue(lane)
        head = lane.inflight[0] if lane.inflight else None
        if head is not None and not head.started and self._admission.admit(lane, head):
            self.start(head)
            self.wait_splits(head)
        if len(lane.inflight) < 2:
            enqueue(lane)

    def start_next(self, lane: Lane) -> BatchContext | None:
        """Admit batch i+1 (its input_dist is its first collective) and start its input_dist,
        waiting for its splits now under an early schedule. None if there is no such batch."""
        nxt = lane.inflight[1] if len(lane.inflight) > 1 else None
        if nxt is None or not self._admission.admit(lane, nxt):
            return None
        self.start(nxt)
        if SCHEDULES[self.schedule].early_splits and not self.wait_splits(nxt):
            return None
        return nxt

    def release_inputs(self, ctx: BatchContext) -> None:
        """`clear_data_dist_inputs`: wait for `ctx`'s values all-to-alls and free what they sent
        (before the batch's input is taken)."""
        if self._memory.clear_data_dist_inputs and ctx.started:
            with self._streams.use(self._streams.data_dist):
                self.freed_bytes += release_sent_inputs(ctx.input_dist_requests.values())
