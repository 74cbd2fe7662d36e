"""torchrec's experimental SparseDist variants, but those acting from backward (`in_backward`): train
and eval batches in one pipeline, eval with the sparse part on the host, and the copy of batch i+2
dispatched from a worker thread (docs/reference.md, "torchrec 1.9's unexported classes")."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeline.compat import PipelineState
from pipeline.options import InputDistOptions, RankOptions, RewriteOptions
from pipeline.pipelines.core import to_device, to_device_in_place
from pipeline.pipelines.sparse_dist import TrainPipelineSparseDist
from pipeline.ranks import Lane, LaneState
from pipeline.stages.context import BatchContext, HostLookupBatchContext, TrainPipelineContext
from pipeline.stages.lookup import LookupStage
from pipeline.stages.streams import Streams, run_stage, streams_for

__all__ = ["EvalPipelineCPUSparse", "TrainEvalHybridPipelineBase", "TrainPipelineSparseDistT"]


class TrainEvalHybridPipelineBase(TrainPipelineSparseDist):
    """SparseDist that trains a batch if the model is in training mode at the `progress()` that returns
    it, else only evaluates it (forward under `no_grad`). Batches are kept per dataloader iterator:
    `progress(eval_it)` returns only `eval_it`'s. Args: `TrainPipelineSparseDist`'s; under
    `execute_all_batches=False` a training iterator's last two batches are dropped; an eval pass runs all."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        context_type: type[BatchContext] = TrainPipelineContext,
        pipeline_postproc: bool = False,
        custom_model_fwd: Callable[[Any], tuple[torch.Tensor, Any]] | None = None,
        dmp_collection_sync_interval_batches: int | None = 1,
        enqueue_batch_after_forward: bool = False,
        enable_inplace_copy_batch: bool = False,
        free_features_storage_early: bool = False,
        clear_data_dist_inputs: bool = False,
        async_inplace_copy: bool = False,
        *,
        strict: bool = False,
        rewrite: RewriteOptions | None = None,
        input_dist: InputDistOptions | None = None,
        ranks: RankOptions | None = None,
        streams: Streams | None = None,
    ) -> None:
        self._setup(
            model,
            optimizer,
            device,
            apply_jit=apply_jit,
            pipeline_postproc=pipeline_postproc,
            custom_model_fwd=custom_model_fwd,
            dmp_collection_sync_interval_batches=dmp_collection_sync_interval_batches,
            enqueue_batch_after_forward=enqueue_batch_after_forward,
            enable_inplace_copy_batch=enable_inplace_copy_batch,
            free_features_storage_early=free_features_storage_early,
            clear_data_dist_inputs=clear_data_dist_inputs,
            strict=strict,
            rewrite=rewrite,
            input_dist=input_dist,
            ranks=ranks,
            streams=streams,
        )  # every batch runs: the training steps' tail rule is `_fill`'s
        self._train_all_batches = execute_all_batches
        self._last_mode: str | None = None

    @property
    def last_output_mode(self) -> str | None:
        """How the batch `progress()` returned last ran: "train" or "eval"; None before."""
        return self._last_mode

    def _fill(self, lane: Lane) -> None:
        draining = lane.state is LaneState.DRAINING
        if self._model.training and not (self._train_all_batches or draining) and not self._look_ahead(lane):
            lane.inflight.clear()  # a training iterator ended before this step's look-ahead: drop all
        self._input_dist.fill(lane, self._enqueue)

    def _step_begins(self, ctx: BatchContext) -> None:
        self._state = PipelineState.IDLE
        super()._step_begins(ctx)

    def _before_forward(self, ctx: BatchContext, nxt: BatchContext | None) -> None:
        self._state = PipelineState.CALL_FWD

    def _after_forward(self, ctx: BatchContext, nxt: BatchContext | None, losses: Any) -> None:
        training = self._model.training
        self._last_mode = "train" if training else "eval"
        if training:
            self._state = PipelineState.CALL_BWD


class EvalPipelineCPUSparse(TrainPipelineSparseDist):
    """Forward-only: the sparse stage (input_dist, lookup, output all-to-all) of batch
    i+`pipeline_depth` on the host; the copy of batch i+1 and its embeddings, and forward of i, on
    `device`. Each output is the model's own under `no_grad`, bit for bit.

    Args (torchrec's, in its order; the others as in `TrainPipelineSparseDist`):
        model: sharded modules on the host, the dense part on `device`.
        optimizer: not used.
        device: where the batch, the embeddings and the dense forward go.
        execute_all_batches: accepted; every batch runs (as in torchrec's class).
        multi_thread: run the sparse stage on a worker thread where it runs no collective.
        pipeline_depth: 1 or 2 (else a ValueError): the batches whose sparse stage runs ahead.
        streams: keyword-only, ours: the device's; None: a memcpy stream on a GPU, none on CPU.

    Raises:
        ValueError: `pipeline_depth` not 1 or 2, or `apply_jit`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        device: torch.device,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        pipeline_postproc: bool = False,
        enable_inplace_copy_batch: bool = False,
        multi_thread: bool = False,
        pipeline_depth: int = 2,
        free_features_storage_early: bool = False,
        clear_data_dist_inputs: bool = False,
        *,
        strict: bool = False,
        rewrite: RewriteOptions | None = None,
        input_dist: InputDistOptions | None = None,
        ranks: RankOptions | None = None,
        streams: Streams | None = None,
    ) -> None:
        if pipeline_depth not in (1, 2):
            raise ValueError(f"pipeline_depth must be 1 or 2; got {pipeline_depth!r}")
        self._setup(
            model,
            optimizer,
            torch.device("cpu"),  # fetched batches stay on the host, where the sparse stage reads them
            apply_jit=apply_jit,
            pipeline_postproc=pipeline_postproc,
            free_features_storage_early=free_features_storage_early,
            clear_data_dist_inputs=clear_data_dist_inputs,
            strict=strict,
            rewrite=rewrite,
            # waited for at once: nothing to schedule (the options' other fields apply)
            input_dist=replace(input_dist or InputDistOptions(), schedule="late"),
            ranks=ranks,
            streams=Streams(),  # the sparse stage's: the host has none
            forward="lookup",
            context_type=HostLookupBatchContext,
            lookahead=0,
            riding=False,  # it admits batches itself
        )
        self._lookup = LookupStage(self._streams, self._input_dist, model, optimizer, forward_only=True)
        self._dense_device = device
        self._dense = streams if streams is not None else streams_for(device, data_dist=False)
        self._in_place = enable_inplace_copy_batch
        self._depth = pipeline_depth
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="pipeline-sparse") if multi_thread else None
        self._local: bool | None = None  # the sparse stage runs no collective; known once one started
        self._job: Future | None = None  # the sparse stage running on the worker
        self._on_reset.append(lambda: self._wait_sparse(discard=True))
        self._on_reset.append(self._dense.discard)  # the dropped batches' copies
        self._on_close.append(self._dense.close)
        if self._worker is not None:
            self._on_close.append(partial(self._worker.shutdown, wait=True))

    def _fill(self, lane: Lane) -> None:
        """Batch i through the sparse stage and the copy; with depth 2, batch i+1's sparse stage."""
        if lane.inflight:
            return
        self._enqueue_sparse(lane, on_worker=False)
        if lane.inflight:
            self._to_device(lane.inflight[0])
        if self._depth == 2 and lane.inflight:
            self._enqueue_sparse(lane, on_worker=False)

    def _step(self, lane: Lane) -> Any:
        ctx = lane.inflight[0]
        self._to_device(ctx)  # a no-op unless its sparse stage ran on the worker (depth 1)
        self._wait_for_batch()
        _, output = self._forward(ctx, train=False, input_dist=self._input_dist)
        # forward only: its use of what memcpy copied is queued (the core releases the host's streams)
        self._dense.release(ctx)
        self._dense.returned(output)
        lane.inflight.popleft()
        if self._depth == 2 and lane.inflight:
            self._to_device(lane.inflight[0])  # batch i+1, whose sparse stage ran in step i-1
        self._enqueue_sparse(lane, on_worker=True)  # batch i+depth
        return output

    def _wait_for_batch(self) -> None:
        """Hand the head batch and its embeddings from memcpy to the caller's stream (torchrec's hook)."""
        ctx = self._lane.inflight[0]
        dense = self._dense
        for obj in (ctx.batch, *ctx.embeddings.values()):
            dense.handoff(obj, dense.memcpy, ctx)
            dense.consumed(obj)

    def detach(self) -> nn.Module:
        self._wait_sparse()  # the worker may be running a sharded module's input_dist
        return super().detach()

    def _enqueue_sparse(self, lane: Lane, *, on_worker: bool) -> None:
        """Fetch a batch and run its sparse stage (on the worker if `on_worker` and it may)."""
        if not self._enqueue(lane):
            return
        ctx = lane.inflight[-1]
        if not self._ranks.admit(lane, ctx):  # its input_dist is its first collective
            return  # dropped on every rank
        if on_worker and self._worker is not None and self._local:
            self._job = self._worker.submit(self._sparse, ctx)
        else:
            self._sparse(ctx)

    def _sparse(self, ctx: HostLookupBatchContext) -> None:
        """input_dist, lookup and outputs of `ctx` (each a no-op once done)."""
        input_dist = self._input_dist
        input_dist.start(ctx)
        input_dist.wait_splits(ctx)  # nothing rides here: its batches were admitted by a vote
        self._lookup.run(ctx)
        for key, (_, _, output) in list(ctx.lookups.items()):
            ctx.embeddings[key] = output.wait()
            del ctx.lookups[key]
        if self._local is None and ctx.started:
            self._local = not _communicates(input_dist.modules)
            if self._worker is not None and not self._local and input_dist.report is not None:
                input_dist.report.notes.append(
                    "multi_thread: the sparse stage runs collectives (tables that are not "
                    "data-parallel), which must not run beside forward's on another thread: it "
                    "runs on the calling thread"
                )

    def _wait_sparse(self, *, discard: bool = False) -> None:
        """Wait for the sparse stage on the worker; re-raise its error unless `discard`."""
        job, self._job = self._job, None
        if job is not None and (job.exception() is None or not discard):
            job.result()

    def _to_device(self, ctx: HostLookupBatchContext) -> None:
        if ctx.on_device:
            return
        self._wait_sparse()
        self._sparse(ctx)  # a no-op once done; else (after a recorded first forward) now
        dense = self._dense
        with run_stage(dense, "copy", ctx.index, dense.memcpy):
            ctx.batch = self._to_dense_device(ctx.batch)
            ctx.embeddings = {key: self._to_dense_device(e) for key, e in ctx.embeddings.items()}
            for obj in (ctx.batch, *ctx.embeddings.values()):
                dense.produced(obj)
        ctx.on_device = True

    def _to_dense_device(self, obj: Any) -> Any:
        if self._dense_device.type == "cpu":
            return obj  # already there
        if self._in_place:
            return to_device_in_place(obj, self._dense_device, self._dense)
        return to_device(obj, self._dense_device, non_blocking=True)


def _communicates(modules: list[Any]) -> bool:
    """Whether the modules' dists move data between ranks (an unknown kind of module: assumed so)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return False
    kinds = [getattr(pm.module, "_sharding_types", None) for pm in modules]
    return any(k is None or any(t != "data_parallel" for t in k) for k in kinds)


class TrainPipelineSparseDistT(TrainPipelineSparseDist):
    """SparseDist with the copy of batch i+2 dispatched from a worker thread (on CPU nothing is copied
    and no thread is used). Args: `TrainPipelineSparseDist`'s (`enable_inplace_copy_batch`: the worker
    allocates)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        context_type: type[BatchContext] = TrainPipelineContext,
        pipeline_postproc: bool = False,
        custom_model_fwd: Callable[[Any], tuple[torch.Tensor, Any]] | None = None,
        dmp_collection_sync_interval_batches: int | None = 1,
        enable_inplace_copy_batch: bool = False,
        free_features_storage_early: bool = False,
        clear_data_dist_inputs: bool = False,
        *,
        strict: bool = False,
        rewrite: RewriteOptions | None = None,
        input_dist: InputDistOptions | None = None,
        ranks: RankOptions | None = None,
        streams: Streams | None = None,
    ) -> None:
        self._setup(
            model,
            optimizer,
            device,
            execute_all_batches=execute_all_batches,
            apply_jit=apply_jit,
            pipeline_postproc=pipeline_postproc,
            custom_model_fwd=custom_model_fwd,
            dmp_collection_sync_interval_batches=dmp_collection_sync_interval_batches,
            enable_inplace_copy_batch=enable_inplace_copy_batch,
            free_features_storage_early=free_features_storage_early,
            clear_data_dist_inputs=clear_data_dist_inputs,
            strict=strict,
            rewrite=rewrite,
            input_dist=input_dist,
            ranks=ranks,
            streams=streams,
        )
        self._copy_worker: ThreadPoolExecutor | None = None  # started at the first copy off the host
        self._on_close.append(self._end_copy_worker)

    def _end_copy_worker(self) -> None:
        if self._copy_worker is not None:
            self._copy_worker.shutdown(wait=True)
            self._copy_worker = None

    def _enqueue_next(self, lane: Lane) -> bool:
        """`_enqueue`, with a copy off the host dispatched on the worker (`InputDist.start` waits)."""
        if self._copy_worker is None and not self._on_host:
            self._copy_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pipeline-copy")
        ctx = self._fetch_and_copy(lane, in_place=self._inplace_copy, worker=self._copy_worker)
        if ctx is None:
            return False
        lane.inflight.append(ctx)
        return True
