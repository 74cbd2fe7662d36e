"""TrainPipelineSparseDist and PrefetchTrainPipelineSparseDist: input_dist runs ahead of forward.

Per `progress()` call that returns batch i:

| stage                                    | stream (CUDA) | batch | SparseDist | Prefetch |
|------------------------------------------|---------------|-------|------------|----------|
| copy host->device                        | memcpy        | i+2   | yes        | yes      |
| input_dist::start (splits all-to-all)    | data_dist     | i+1   | yes        | yes      |
| input_dist::splits (values all-to-all)   | data_dist     | i+1   | yes        | yes      |
| prefetch (input_dist::wait + prefetch()) | prefetch      | i     | -          | yes      |
| forward (SparseDist: input_dist::wait)   | current       | i     | yes        | yes      |
| backward, optimizer                      | current       | i     | yes        | yes      |

The table shows the "early" input_dist schedule: the splits of batch i+1 are waited for before
forward of i, so its values all-to-all is under way during the whole forward, backward and optimizer
step of i, on a process group of its own so that backward's collectives do not queue behind it. The
"late" schedule is torchrec's: the splits are waited for after forward, on torchrec's group;
"early-shared" and "late-own" make the two choices the other way round. "auto" (the default)
measures them in paired rounds over the first training steps and keeps torchrec's order unless
another is significantly faster (`pipeline.schedule`).
The splits all-to-alls of all modules on a process group are fused into one collective from the
second batch on (input dists are created on the first). On CPU the collectives run in gloo's
threads, so the overlap is real there too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embedding_sharding import FusedKJTListSplitsAwaitable, KJTSplitsAllToAllMeta

from pipeline.base import TrainPipelineBase, _Lane
from pipeline.context import BatchContext
from pipeline.labels import stage
from pipeline.schedule import OPTIONS, SCHEDULES
from pipeline.streams import Streams
from pipeline.tuner import Tuner
from rewrite import ContextSlot, InputDistGroups, Rewrite, RewriteReport, rewrite_model

__all__ = ["TrainPipelineSparseDist"]


class TrainPipelineSparseDist(TrainPipelineBase):
    """Overlaps input_dist of batch i+1 and the copy of batch i+2 with the compute of batch i.

    Args:
        model: usually a DistributedModelParallel; returns `(loss, output)` in training mode.
        optimizer: stepped after each training batch's backward.
        device: where batches are copied to.
        execute_all_batches: run the batches in flight once the dataloader is exhausted (True), or
            drop them as torchrec does (False; docs/pipeline.md says which).
        apply_jit: not supported (kept for torchrec's signature); must be False.
        context_type: ignored (kept for torchrec's signature): contexts are internal.
        pipeline_postproc: run parameter-free modules that transform the batch ahead with
            input_dist, instead of leaving their sharded consumers unpipelined.
        custom_model_fwd: called with the batch instead of `model`.
        arg_paths: explicit `{sharded_module_fqn: path}`, e.g. `{"sparse_arch.ebc": "sparse"}`;
            FQNs are relative to the unwrapped model (see `rewrite_report`).
        rewrite_method: "auto", "explicit", "trace" or "direct" (see docs/rewrite.md).
        strict: fail on the first batch if any sharded module cannot be pipelined.
        input_dist_schedule: "auto" (default), "early", "late", "early-shared" or "late-own":
            when the next batch's input all-to-alls run and on which process group (module
            docstring, `pipeline.schedule`). "early", "late-own" and "auto" create one more process
            group per input_dist group the first time they use it (on NCCL a communicator, whose
            buffers take GPU memory); "late" and "early-shared" never do.
        tuner: under "auto", the `pipeline.schedule.Tuner` to use (its candidates, rounds,
            margin, re-check interval); default `Tuner()`. Ignored by the other schedules.
        streams: stream implementation (tests pass `RecordingStreams()`).
        **ranks: `on_uneven`, `check_keys`, `agreement`, `abort_on_error`, `peer_timeout`: how the
            ranks agree on uneven data, wrong keys and failures (see `TrainPipelineBase`).
    """

    _context_type: type[BatchContext] = BatchContext
    _prefetch = False

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        context_type: Any = None,
        pipeline_postproc: bool = False,
        custom_model_fwd: Callable[[Any], Any] | None = None,
        *,
        arg_paths: dict[str, str] | None = None,
        rewrite_method: str = "auto",
        strict: bool = False,
        input_dist_schedule: str = "auto",
        tuner: Tuner | None = None,
        streams: Streams | None = None,
        **ranks: Any,
    ) -> None:
        if apply_jit:
            raise ValueError("apply_jit=True is not supported by this pipeline; leave it False")
        if input_dist_schedule not in OPTIONS:
            raise ValueError(
                f"input_dist_schedule must be one of {', '.join(OPTIONS)}; got {input_dist_schedule!r}"
            )
        super().__init__(
            model,
            optimizer,
            device,
            custom_model_fwd,
            execute_all_batches=execute_all_batches,
            streams=streams,
            **ranks,
        )
        self._rewrite_options = dict(
            method=rewrite_method,
            paths=arg_paths,
            pipeline_postproc=pipeline_postproc,
            strict=strict,
            prefetch=self._prefetch,
        )
        self._slot = ContextSlot()
        self._rewrite: Rewrite | None = None
        self._report: RewriteReport | None = None
        self._tuner = (tuner or Tuner()) if input_dist_schedule == "auto" else None
        self._schedule = "late" if input_dist_schedule == "auto" else input_dist_schedule
        self._groups = InputDistGroups()
        self._undo_groups: Callable[[], None] | None = None

    @property
    def input_dist_schedule(self) -> str:
        """The input_dist schedule in use, a name from `pipeline.schedule.SCHEDULES` (under "auto",
        changes while tuning and may change at a re-check)."""
        return self._schedule

    @property
    def tuner(self) -> Tuner | None:
        """Under "auto", the tuner: `choice`, `reason`, `medians_ms` and `decisions` once it has
        decided."""
        return self._tuner

    @property
    def rewrite_report(self) -> RewriteReport | None:
        """What the rewrite did to each sharded module; None before the first `progress()`."""
        return self._report

    def detach(self) -> nn.Module:
        """Restore every original forward; the next `progress()` re-attaches.

        Batches in flight are kept and resume with the next `progress()` on their iterator.

        Returns:
            The model, as it was before the pipeline touched it.
        """
        self._restore_groups()
        if self._rewrite is not None:
            self._rewrite.restore()
            self._rewrite = None
        self._slot.current = None
        return self._model

    # -- the schedule -------------------------------------------------------------------------

    def _fill(self, lane: _Lane) -> None:
        if not lane.inflight:
            self._enqueue(lane)
        if lane.inflight and not lane.inflight[0].started and self._admit(lane, lane.inflight[0]):
            self._start_input_dist(lane.inflight[0])
            self._wait_splits(lane.inflight[0])
        if len(lane.inflight) < 2:
            self._enqueue(lane)

    def reset(self) -> None:
        super().reset()
        if self._tuner is not None:
            self._tuner.interrupt()

    def _step(self, lane: _Lane) -> Any:
        ctx = lane.inflight[0]
        if self._tuner is not None:
            if self._model.training:
                self._schedule = self._tuner.next_schedule()
            else:
                self._tuner.interrupt()
        if len(lane.inflight) < 3:
            self._enqueue(lane)
        nxt = lane.inflight[1] if len(lane.inflight) > 1 else None
        if nxt is not None and not self._admit(lane, nxt):  # its input_dist is its first collective
            nxt = None
        if nxt is not None:
            self._start_input_dist(nxt)
            if SCHEDULES[self._schedule].early_splits:
                self._wait_splits(nxt)
                self._after_splits(nxt)
        self._before_forward(ctx)
        losses, output = self._forward(ctx)
        if nxt is not None:
            self._wait_splits(nxt)  # late splits (a no-op after early ones)
            self._after_forward(nxt)
            if nxt.splits_span_world:  # every rank fetched the batch after nxt before these splits
                self._read_flags_ahead(lane, 2)
        if losses is not None:
            self._backward_and_step(ctx, losses)
        lane.inflight.popleft()
        if nxt is None or not nxt.splits_span_world:
            self._read_flags_ahead(lane, 1)  # after this step's collectives, as TrainPipelineBase
        return output

    def _before_forward(self, ctx: BatchContext) -> None:
        pass

    def _after_splits(self, nxt: BatchContext) -> None:
        """`nxt`'s values all-to-all is under way, before forward of the head batch (early splits)."""

    def _after_forward(self, nxt: BatchContext) -> None:
        """Forward of the head batch is done and `nxt`'s values all-to-all is under way."""

    def _lookahead(self, lane: _Lane) -> int:
        # torchrec's fetches batch i+2 during step i and stops there when it is missing
        return 2

    def _call_model(self, ctx: BatchContext) -> Any:
        self._slot.current = ctx
        try:
            return self._model_fwd(ctx.batch)
        finally:
            self._slot.current = None

    # -- input_dist ---------------------------------------------------------------------------

    def _attach(self, batch: Any) -> Rewrite:
        if self._rewrite is None:
            self._rewrite = rewrite_model(self._model, batch, slot=self._slot, **self._rewrite_options)
            self._report = self._rewrite.report
        return self._rewrite

    def _start_input_dist(self, ctx: BatchContext) -> None:
        """Launch the splits all-to-all of every pipelined module for `ctx`'s batch."""
        if ctx.started:
            return
        streams = self._streams
        rewrite = self._attach(ctx.batch)
        fused = rewrite.fuse_splits()
        if fused:
            self._place_all_to_alls(rewrite)

        def postproc(call: Any, batch: Any) -> Any:
            return rewrite.run_postproc(call, batch, ctx.postproc_results)

        with stage(streams, "input_dist::start", ctx.index, streams.data_dist):
            streams.handoff(ctx.batch, streams.memcpy)
            streams.consumed(ctx.batch)
            requests = {}
            for pm in rewrite.modules:
                args, kwargs = pm.args.build(ctx.batch, postproc)
                args, kwargs = pm.module.preprocess_input(args, kwargs)
                module_ctx = ctx.module_contexts[pm.fqn] = pm.module.create_context()
                requests[pm.fqn] = pm.module.input_dist(module_ctx, *args, **kwargs)
            for result in ctx.postproc_results.values():
                streams.produced(result)
            if fused:
                ctx.splits_requests, groups = _fuse(requests, ctx.module_contexts)
                ctx.splits_span_world = any(pg is not None and pg.size() == _world_size() for pg in groups)
            else:
                ctx.splits_requests = [([name], _One(request)) for name, request in requests.items()]
        ctx.started = True

    def _place_all_to_alls(self, rewrite: Rewrite) -> None:
        """Input all-to-alls on their own groups or on torchrec's, as the schedule says."""
        own = SCHEDULES[self._schedule].own_group
        if own and self._undo_groups is None:
            self._undo_groups = self._groups.install([pm.module for pm in rewrite.modules])
        elif not own:
            self._restore_groups()

    def _restore_groups(self) -> None:
        """Put the input all-to-alls back on the groups torchrec made them with."""
        if self._undo_groups is not None:
            self._undo_groups()
            self._undo_groups = None

    def _wait_splits(self, ctx: BatchContext) -> None:
        """Wait for the splits all-to-all of `ctx` and launch its values all-to-alls."""
        with stage(self._streams, "input_dist::splits", ctx.index, self._streams.data_dist):
            for names, request in ctx.splits_requests:
                for name, values in zip(names, request.wait(), strict=True):
                    ctx.input_dist_requests[name] = values
            ctx.splits_requests = []


class _One:
    """Makes one module's splits awaitable look like a fused one (a list of one result)."""

    def __init__(self, request: Any) -> None:
        self._request = request

    def wait(self) -> list[Any]:
        return [self._request.wait()]


def _fuse(
    requests: dict[str, Any], module_contexts: dict[str, Any]
) -> tuple[list[tuple[list[str], Any]], list[Any]]:
    """One splits all-to-all per process group, over every module using that group; and the groups
    (None for modules without a splits all-to-all)."""
    groups: dict[int, tuple[Any, list[str]]] = {}
    for name, request in requests.items():
        metas = [a for a in getattr(request, "awaitables", []) if isinstance(a, KJTSplitsAllToAllMeta)]
        pg = metas[0].pg if metas else None
        groups.setdefault(id(pg), (pg, []))[1].append(name)
    fused = [
        (
            names,
            FusedKJTListSplitsAwaitable(
                requests=[requests[n] for n in names],
                contexts=[module_contexts[n] for n in names],
                pg=pg,
            ),
        )
        for pg, names in groups.values()
    ]
    return fused, [pg for pg, _ in groups.values()]


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
