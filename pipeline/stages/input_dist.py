"""`InputDist`, the stage that starts a batch's input all-to-alls and waits their splits; the rewrite
as it holds it (`Attachment`), `NotPipelinedWarning` and torchrec's memory flags (`MemoryFlags`)."""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.dist_data import KJTAllToAllTensorsAwaitable

from pipeline.options import InputDistOptions, RewriteOptions
from pipeline.ranks import Lane, Ranks
from pipeline.ranks.riding import Admission
from pipeline.stages.context import BatchContext
from pipeline.stages.narrow import NarrowIds, every_rank, kjts_in, originals, widen_received
from pipeline.stages.schedule import (
    NOT_ON_NCCL,
    ONE_RANK,
    SCHEDULES,
    WATCH_ADVICE,
    InputDistGroups,
    ScheduleWatch,
    backend_on,
)
from pipeline.stages.streams import Streams, run_stage
from pipeline.stages.watch import FINAL
from rewrite import CallSite, ContextSlot, PipelinedModule, Rewrite, RewriteReport, rewrite_model
from rewrite.replay import fuse_splits_requests, kjt_all_to_alls, one_by_one

__all__ = ["Attachment", "InputDist", "MemoryFlags", "NotPipelinedWarning"]

logger = logging.getLogger("pipeline")


class InputDist:
    """Input all-to-alls of every pipelined sharded module of `model`, batch by batch.

    Args:
        model: the model the pipeline runs (its sharded modules are rewritten on `attach`).
        streams: the pipeline's streams (the all-to-alls run on `data_dist`).
        rewrite: how the sharded modules' inputs are found (`RewriteOptions`).
        strict: fail on the first batch if a sharded module cannot be pipelined.
        pipeline_postproc: run parameter-free modules that transform the batch ahead.
        schedule: the schedule, its watch, and whether ids are narrowed (`InputDistOptions`).
        memory: torchrec's memory flags (`MemoryFlags`).
        forward: the sharded modules' hijacked forward: "input_dist", "prefetch" or "lookup".
        carry: statuses may ride on the fused splits (the pipeline admits through `fill`, `start_next`).
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
        """One rank: the splits are not fused, and every schedule does the same work."""
        self.freed_bytes = 0
        """Bytes released by the memory flags so far."""
        self._ranks = ranks
        if self.watch is not None:
            self.watch.note = self._note
            if self._one_rank:
                self.watch.pin(ONE_RANK)
        self._admission = Admission(ranks, carry, watch=self.watch)
        """Whether each batch is trained: by its vote, or what rides on its splits (else pins the watch)."""
        check = ranks.kjts if ranks is not None else None
        self._narrow = NarrowIds(
            schedule.narrow_ids,
            self._note,
            one_rank=self._one_rank,
            proven=check.in_int32 if check is not None else None,
            untabled=check.untabled if check is not None else frozenset(),
        )
        """Which call sites' KJTs go through the all-to-all as int32 (`pipeline.stages.narrow`)."""
        self._groups_checked = False
        """Whether the watch was pinned where the input all-to-alls cannot move (`_check_groups`)."""
        self._others: list[Any] = []
        """Other stages' watches (`add_watch`)."""
        self._groups = (
            InputDistGroups(ranks.new_group, self._note, ranks.groups.destroy)
            if ranks is not None
            else InputDistGroups(dist.new_group, self._note)
        )

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
        """Call at the start of each step: under "adaptive", the watch picks a training step's schedule."""
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
        """Let another stage's watch (`pipeline.stages.prefetch.PrefetchWatch`) publish in the words."""
        watch.note = self._note
        self._others.append(watch)
        if self._one_rank:
            watch.no_ride("one rank")
        self._admission.add_watch(watch)

    def use_forward(self, forward: str) -> None:
        """Change which hijacked forward the sharded modules get, before the first batch (see the class)."""
        self._attached.use_forward(forward)

    def step_ended(self) -> None:
        """Call when a step ended: the watches stop its clock."""
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
        rewrite = self._attached.rewrite
        steady = rewrite is not None and not rewrite.needs_recording
        return None if steady else self._attached.recording(ctx.batch)

    def _agree(self, rewrite: Rewrite, ctx: BatchContext) -> None:
        """Once the rewrite is complete: every rank must have found the same call sites and have the same
        live watches' settings (else every rank raises); then which sites narrow."""
        if self._ranks is not None:
            self._ranks.agree_on("call sites of the sharded modules", rewrite.signature())
            live = [w.settings() for w in (self.watch, *self._others) if w is not None and w.publishing]
            if live:  # the watches decide from the words alike only with the same settings
                self._ranks.agree_on("watch settings", "\n".join(live), advice=WATCH_ADVICE)
        sample = partial(rewrite.site_inputs, ctx.batch, ctx.postproc_results)
        self._narrow.settle(rewrite.sites, sample, self._ranks.gather if self._ranks else every_rank)

    def _check_groups(self, rewrite: Rewrite, ctx: BatchContext) -> None:
        """At the first fused start: pin the watch, saying why, where it could not move the input
        all-to-alls (NCCL, or no group like theirs can be made); every rank decides alike."""
        if self.watch is None or self.watch.choice is not None:
            return
        inputs = rewrite.site_inputs(ctx.batch, ctx.postproc_results)
        device = next((kjt.device() for kjt in kjts_in(inputs)), torch.device("cpu"))
        groups = {id(a2a._pg): a2a._pg for pm in rewrite.modules for a2a in kjt_all_to_alls(pm.module)}
        if any(backend_on(pg, device) == "nccl" for pg in groups.values()):
            self.watch.pin(NOT_ON_NCCL)
        elif (why := self._groups.uncopyable(list(groups.values()))) is not None:
            self.watch.pin(f"a process group like the input all-to-alls' cannot be made here ({why})")

    def detach(self) -> None:
        """Restore every original forward and process group; the next `start` re-attaches."""
        self._groups.restore()
        self._admission.forget()
        self._attached.detach()
        self.slot.current = None

    def close(self) -> None:
        """`detach`, and the input all-to-alls' own process groups destroyed (no batch in flight)."""
        self.detach()
        self._groups.close()

    def start(self, ctx: BatchContext) -> None:
        """Launch the splits all-to-alls of `ctx`'s batch (fused into one per group from the second batch
        on); nothing while the rewrite waits for a recorded forward."""
        if ctx.started:
            return
        own = SCHEDULES[self.schedule].own_group
        if self._admission.without_batch(ctx):  # zero splits where the others send theirs
            self._groups.place(own, self.rewrite.modules, ctx.index)
            ctx.splits_requests, ctx.started = self._admission.status_only(ctx, self._groups.current), True
            return
        if ctx.copy_job is not None:
            ctx.wait_copy()
        streams, rewrite = self._streams, self._attached.rewrite
        rewrite = rewrite if rewrite is not None else self.attach(ctx.batch)
        if rewrite.needs_recording:
            return
        if not self._attached.accepted:
            self._attached.accept(rewrite, lambda r: self._agree(r, ctx))
        fused = not self._one_rank and (rewrite.fused or rewrite.fuse_splits())
        if fused and not self._admission.checked:
            why = self._admission.check([pm.module for pm in rewrite.modules])
            rewrite.report.notes += [why] if why else []
        if fused and not self._groups_checked:
            self._groups_checked = True
            self._check_groups(rewrite, ctx)
        if fused and own is not self._groups.on_own:  # else nothing to move or retire
            self._groups.place(own, rewrite.modules, ctx.index)

        with run_stage(streams, "input_dist::start", ctx.index, streams.data_dist):
            if not streams.in_order:
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
                status_splits = self._admission.status_splits(ctx)
                ctx.splits_requests = fuse_splits_requests(
                    requests, ctx.module_contexts, status_splits=status_splits
                )
                self._admission.learn(ctx.splits_requests)
            else:
                ctx.splits_requests = one_by_one(requests)
        ctx.started = True
        watch = self.watch
        if watch is not None and watch.phase not in FINAL:  # its `active_clock`, read without a call
            ctx.wait_clock = watch.waits

    def wait_splits(self, ctx: BatchContext, lane: Lane | None = None) -> bool:
        """Wait for the splits all-to-all of `ctx` and launch its values all-to-alls (a no-op once done).
        Where the batch's status rode on it, the ranks' statuses decide first: `lane` is then needed.

        Returns:
            False: some rank lacks the batch; it and the batches after it left `lane`.
        """
        with run_stage(self._streams, "input_dist::splits", ctx.index, self._streams.data_dist):
            # The whole wait is timed (`WaitClock.timed`, in place): where the status rides,
            # `read_statuses` is where it blocks.
            clock = ctx.wait_clock
            if clock is None or clock.thread != threading.get_ident():
                return self._wait_splits(ctx, lane)
            start = clock.now()
            try:
                return self._wait_splits(ctx, lane)
            finally:
                clock.waited += clock.now() - start

    def _wait_splits(self, ctx: BatchContext, lane: Lane | None) -> bool:
        if not self._admission.read_statuses(ctx, lane):
            return False
        narrowed = self._narrow.sites
        for names, request in ctx.splits_requests:
            for name, values in zip(names, request.wait(), strict=True):
                ctx.input_dist_requests[name] = widen_received(values) if name in narrowed else values
        ctx.splits_requests = []
        return True

    # -- the next batch, within a step (the pipelines' steps call these by name) ---------------

    def fill(self, lane: Lane, enqueue: Callable[[Lane], bool]) -> None:
        """Before a step: the head batch admitted, its input_dist started and splits waited; i+1 copied."""
        if not lane.inflight:
            enqueue(lane)
        head = lane.inflight[0] if lane.inflight else None
        if head is not None and not head.started and self._admission.admit(lane, head):
            self.start(head)
            self.wait_splits(head, lane)
        if len(lane.inflight) < 2:
            enqueue(lane)

    def start_next(self, lane: Lane) -> BatchContext | None:
        """Admit batch i+1 and start its input_dist (its splits waited now under an early schedule);
        None if there is no such batch."""
        nxt = lane.inflight[1] if len(lane.inflight) > 1 else None
        if nxt is None or not self._admission.admit(lane, nxt):
            return None
        self.start(nxt)
        if SCHEDULES[self.schedule].early_splits and not self.wait_splits(nxt, lane):
            return None
        return nxt

    def release_inputs(self, ctx: BatchContext) -> None:
        """`clear_data_dist_inputs`: wait for `ctx`'s values all-to-alls and free what they sent."""
        if self._memory.clear_data_dist_inputs and ctx.started:
            with self._streams.use(self._streams.data_dist):
                self.freed_bytes += release_sent_inputs(ctx.input_dist_requests.values())


# -- the rewrite, as the stage holds it --------------------------------------------------------------


class Attachment:
    """The rewrite of `model`'s sharded modules, made on the first batch and undone by `detach`. Its
    arguments are `InputDist`'s (`options`: its `rewrite`), `slot`, where the hijacked forwards read
    the running batch's context, and `free_early`: `free_features_storage_early` was asked for."""

    def __init__(
        self,
        model: nn.Module,
        slot: ContextSlot,
        *,
        options: RewriteOptions,
        strict: bool,
        pipeline_postproc: bool,
        forward: str,
        free_early: bool,
    ) -> None:
        self._model, self._slot, self._options = model, slot, options
        self._strict, self._pipeline_postproc = strict, pipeline_postproc
        self._forward, self._asked_free_early = forward, free_early
        self.rewrite: Rewrite | None = None
        """The rewrite, from the first batch until `detach`."""
        self.accepted = False
        """The complete rewrite was checked (`accept`)."""
        self.free_early = False
        """`free_features_storage_early` applies (every call site's input is a path in the batch)."""
        self._undo: Callable[[], None] | None = None
        """Undoes `free_features_storage_early` (set where it applies)."""
        self._warned: set[str] = set()
        """The modules warned about as not pipelined (once each, not again at a re-attach)."""

    @property
    def report(self) -> RewriteReport | None:
        return self.rewrite.report if self.rewrite is not None else None

    @property
    def modules(self) -> list[PipelinedModule]:
        return self.rewrite.modules if self.rewrite is not None else []

    @property
    def sites(self) -> list[CallSite]:
        return self.rewrite.sites if self.rewrite is not None else []

    def use_forward(self, forward: str) -> None:
        """Change which hijacked forward the sharded modules get, before the first batch rewrote them.

        Raises:
            RuntimeError: the modules are rewritten already.
        """
        if self.rewrite is not None:
            raise RuntimeError("the sharded modules are rewritten already; detach() first")
        self._forward = forward

    def attach(self, batch: Any) -> Rewrite:
        """Rewrite the sharded modules once, with `batch` as the sample (it may wait for `recording`)."""
        if self.rewrite is None:
            options = self._options
            self.rewrite = rewrite_model(
                self._model,
                batch,
                slot=self._slot,
                prefetch=self._forward == "prefetch",
                lookup=self._forward == "lookup",
                method=options.method,
                paths=options.arg_paths,
                pipeline_postproc=self._pipeline_postproc,
                strict=self._strict,
                record=True,
            )
            self.accepted = False
        return self.rewrite

    def recording(self, batch: Any) -> Any:
        """While the rewrite waits for a recorded forward: the context manager to run `batch`'s forward
        in, unpipelined (it completes the rewrite). None: the forward is pipelined."""
        rewrite = self.attach(batch)
        return rewrite.record(batch) if rewrite.needs_recording else None

    def accept(self, rewrite: Rewrite, check: Callable[[Rewrite], None]) -> None:
        """Once the rewrite is complete: warn about each module not pipelined, run `check` (it may raise
        on every rank), then apply `free_features_storage_early` where safe."""
        self.accepted = True
        warn_not_pipelined(rewrite.report, self._warned, pipeline_postproc=self._pipeline_postproc)
        check(rewrite)
        self._undo = free_early_where_safe(rewrite) if self._asked_free_early else None
        self.free_early = self._undo is not None

    def detach(self) -> None:
        """Undo `free_features_storage_early` and restore every original forward."""
        if self._undo is not None:
            self._undo()
            self._undo = None
        if self.rewrite is not None:
            self.rewrite.restore()
            self.rewrite = None
        self.accepted = self.free_early = False


# -- a module not pipelined --------------------------------------------------------------------------


class NotPipelinedWarning(UserWarning):
    """A sharded module is not pipelined: it runs its own forward, without overlap (training is
    unchanged). Warned once per module and pipeline, also to the "pipeline" logger."""


def warn_not_pipelined(report: RewriteReport, warned: set[str], *, pipeline_postproc: bool) -> None:
    """Warn about each module of `report` not pipelined and not in `warned` (then add it); the message
    suggests `pipeline_postproc` where it is off."""
    for module in report.not_pipelined:
        if module.fqn in warned:
            continue
        warned.add(module.fqn)
        fqn, reason = module.fqn, module.reason or "no reason recorded"
        postproc = (
            ""
            if pipeline_postproc
            else "; pipeline_postproc=True, if its input comes out of a parameter-free module that "
            "transforms the batch"
        )
        message = (
            f"sharded module {fqn!r} is not pipelined: {reason}. It runs its own forward, so its input "
            "all-to-alls do not overlap the previous batch (training is unchanged). To pipeline it, pass "
            f"rewrite=RewriteOptions(arg_paths={{{fqn!r}: <path of its input in the batch>}}){postproc}; "
            "or strict=True to make this an error."
        )
        logger.warning(message)
        warnings.warn(message, NotPipelinedWarning, stacklevel=2)


# -- torchrec's memory flags -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MemoryFlags:
    """torchrec's two memory flags of the input_dist stage (docs/reference.md, "torchrec's flags on CPU")."""

    free_features_storage_early: bool = False
    """Free the storage of a batch's KeyedJaggedTensor once every pipelined module's input_dist has
    its own permuted copy; the batch's KJT is empty afterwards."""
    clear_data_dist_inputs: bool = False
    """Before forward of a batch, wait for its input all-to-alls and free the tensors they sent."""


def free_early_where_safe(rewrite: Any) -> Callable[[], None] | None:
    """Where forward never reads the batch's features: tell each sharded module that knows the flag to
    keep its input for release, and return the undo; else a note and None."""
    computed = [site.key for site in rewrite.sites if not site.args.is_path]
    if computed:
        rewrite.report.notes.append(
            "free_features_storage_early is off: forward computes the input of "
            f"{', '.join(computed)} from the batch's tensors, which freeing would break"
        )
        return None
    changed = [
        pm.module
        for pm in rewrite.modules
        if hasattr(pm.module, "_free_features_storage_early") and not pm.module._free_features_storage_early
    ]
    for module in changed:
        module._free_features_storage_early = True

    def undo() -> None:
        for module in changed:
            module._free_features_storage_early = False

    return undo


def release_features(module_contexts: Iterable[Any], narrowed: Mapping[int, Any] | None = None) -> int:
    """Free the original features the modules' contexts hold for release; returns the bytes. `narrowed`
    maps a narrowed copy's id to the batch's KJT, freed too (`pipeline.stages.narrow`)."""
    size = 0
    originals = dict(narrowed or {})
    for module_ctx in module_contexts:
        releasable = getattr(module_ctx, "early_releasable_inputs", None)
        if releasable:
            also = [originals.pop(id(kjt)) for kjt in releasable if id(kjt) in originals]
            size += sum(kjt.clear_storage() for kjt in [*releasable, *also])
            releasable.clear()
    return size


def release_sent_inputs(requests: Iterable[Any]) -> int:
    """Wait for each values all-to-all among `requests` and free what it sent; returns the bytes."""
    size = 0
    for request in requests:
        for awaitable in getattr(request, "awaitables", None) or []:
            if isinstance(awaitable, KJTAllToAllTensorsAwaitable):
                size += awaitable.clear_inputs()
    return size
