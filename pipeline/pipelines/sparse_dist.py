"""`TrainPipelineSparseDist`, whose one step has hooks its subclasses override (docs/architecture.md,
"One SparseDist step, with named hooks"), with torchrec's public methods of the family, and the
family's `TrainPipelineSparseDistLite` and `EvalPipelineSparseDist`."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from pipeline.compat import PipelineState, refuse_jit
from pipeline.compat.backward_injection import InjectionSite, register_backward_hook
from pipeline.options import InputDistOptions, RankOptions, RewriteOptions
from pipeline.pipelines.core import PipelineCore
from pipeline.ranks import Lane
from pipeline.stages.context import BatchContext, TrainPipelineContext
from pipeline.stages.input_dist import InputDist, MemoryFlags
from pipeline.stages.schedule import ScheduleWatch
from pipeline.stages.streams import Streams, label, run_stage, streams_for
from rewrite import RewriteReport, unwrap_model

__all__ = ["Batches", "EvalPipelineSparseDist", "TrainPipelineSparseDist", "TrainPipelineSparseDistLite"]


class TrainPipelineSparseDist(PipelineCore):
    """Overlaps input_dist of batch i+1 and the copy of batch i+2 with the compute of batch i.

    Args (torchrec's, in its order):
        model: usually a DistributedModelParallel; returns `(loss, output)` in training mode.
        optimizer: stepped after each training batch's backward.
        device: where batches are copied to.
        execute_all_batches: run the batches in flight at the dataloader's end, or drop the last two.
        apply_jit: not supported; must be False.
        context_type: accepted, unused (the per-batch contexts are internal).
        pipeline_postproc: run parameter-free modules that transform the batch ahead with input_dist.
        custom_model_fwd: called with the batch instead of `model`.
        dmp_collection_sync_interval_batches: a `DMPCollection`'s replica sync interval (None: never).
        enqueue_batch_after_forward: copy batch i+2 after forward of i instead of before it.
        enable_inplace_copy_batch: allocate the device copy on the stream that uses it (GPU).
        free_features_storage_early: free a batch's KJT storage once every module has its copy.
        clear_data_dist_inputs: free what the input all-to-alls sent before forward.
        async_inplace_copy: accepted, no effect (ours dispatches the copy on the caller's thread).

    Keyword-only, ours (`pipeline.options`):
        strict: fail on the first batch if a sharded module cannot be pipelined.
        rewrite: how the sharded modules' inputs are found (`RewriteOptions`).
        input_dist: the input_dist schedule and the width of the ids sent (`InputDistOptions`).
        ranks: how the ranks agree on every batch, and fail (`RankOptions`).
        streams: the streams to run on; None: CUDA streams on a GPU, none on CPU.

    Raises:
        ValueError: `apply_jit`, or a sync interval other than 1 or None without a `DMPCollection`.
    """

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
            execute_all_batches=execute_all_batches,
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
        )

    def _setup(
        self,
        model: nn.Module,
        optimizer: Any,
        device: torch.device,
        *,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        pipeline_postproc: bool = False,
        custom_model_fwd: Callable[[Any], Any] | None = None,
        dmp_collection_sync_interval_batches: int | None = 1,
        enqueue_batch_after_forward: bool = False,
        enable_inplace_copy_batch: bool = False,
        free_features_storage_early: bool = False,
        clear_data_dist_inputs: bool = False,
        strict: bool = False,
        rewrite: RewriteOptions | None = None,
        input_dist: InputDistOptions | None = None,
        ranks: RankOptions | None = None,
        streams: Streams | None = None,
        forward: str = "input_dist",
        context_type: type[BatchContext] = BatchContext,
        lookahead: int = 2,
        forward_only: bool = False,
        riding: bool = True,
    ) -> None:
        """The family's one construction. Besides the constructors' arguments: `forward` (`InputDist`'s),
        `context_type` and `lookahead` (`PipelineCore`'s), `forward_only` (no backward, whatever the
        model's mode) and `riding` (False: a class that admits its batches itself)."""
        refuse_jit(apply_jit)
        PipelineCore.__init__(
            self,
            model,
            optimizer,
            device,
            execute_all_batches=execute_all_batches,
            custom_model_fwd=custom_model_fwd,
            streams=streams,
            ranks=ranks,
            enable_inplace_copy_batch=enable_inplace_copy_batch,
            dmp_collection_sync_interval_batches=dmp_collection_sync_interval_batches,
            context_type=context_type,
            lookahead=lookahead,
        )
        self._enqueue_batch_after_forward = enqueue_batch_after_forward
        self._clear_data_dist_inputs = clear_data_dist_inputs  # torchrec's attribute
        self._train = not forward_only
        self._input_dist = InputDist(
            model,
            self._streams,
            rewrite=rewrite or RewriteOptions(),
            strict=strict,
            pipeline_postproc=pipeline_postproc,
            schedule=input_dist or InputDistOptions(),
            memory=MemoryFlags(free_features_storage_early, clear_data_dist_inputs),
            forward=forward,
            ranks=self._ranks,
            carry=riding and execute_all_batches,  # a look-ahead admits itself
        )
        self._on_reset.append(self._input_dist.interrupt)
        self._on_step_end.append(self._input_dist.step_ended)
        self._on_close.append(self._input_dist.close)

    # -- what users read ----------------------------------------------------------------------------

    @property
    def input_dist_schedule(self) -> str:
        """The input_dist schedule in use (under "adaptive" it may change: `tuner`)."""
        return self._input_dist.schedule

    @property
    def tuner(self) -> ScheduleWatch | None:
        """Under "adaptive", the schedule watch (`print(pipe.tuner)` says what it saw and decided); None
        where the schedule is pinned."""
        return self._input_dist.watch

    @property
    def rewrite_report(self) -> RewriteReport | None:
        """What the rewrite did to each sharded module; None before the first `progress()`."""
        return self._input_dist.report

    @property
    def released_bytes(self) -> int:
        """Bytes that `free_features_storage_early` and `clear_data_dist_inputs` released so far."""
        return self._input_dist.freed_bytes

    def detach(self) -> nn.Module:
        """Restore every original forward; batches in flight resume at the next `progress()`, re-attached.

        Returns:
            The model, as it was before the pipeline touched it.

        Raises:
            BaseException: work on a side stream (a prefetch submitted ahead) failed and nothing
                raised its error yet; the model is restored all the same.
        """
        try:
            self._streams.wait_all()
        finally:
            self._input_dist.detach()
        return self._model

    def attach(self, model: nn.Module | None = None, sparse_dist: bool = True) -> None:
        """torchrec's counterpart of `detach()`; optional here, since `progress()` re-attaches.

        Raises:
            ValueError: `model` is not the pipeline's model (build a new pipeline for another).
        """
        if model is not None and model is not self._model:
            raise ValueError("attach(model) takes the pipeline's own model; build a new pipeline for another")

    # -- the step -----------------------------------------------------------------------------------

    def _fill(self, lane: Lane) -> None:
        inflight = lane.inflight
        if len(inflight) < 2 or not inflight[0].started:  # else full: `InputDist.fill` would do nothing
            self._input_dist.fill(lane, self._enqueue)

    def _step(self, lane: Lane) -> Any:
        """The copy of batch i+2 and the input_dist of i+1 overlap forward, backward and optimizer of i."""
        ctx, input_dist = lane.inflight[0], self._input_dist
        input_dist.choose_schedule(self._train and self._model.training)
        self._step_begins(ctx)
        copy_late = self._enqueue_batch_after_forward
        if not copy_late and len(lane.inflight) < 3:
            self._enqueue_next(lane)
        nxt = input_dist.start_next(lane)  # waits for its copy where it was dispatched on a worker
        self._before_forward(ctx, nxt)
        self._wait_for_batch()
        losses, output = self._forward(ctx, train=self._train, input_dist=input_dist)
        if copy_late and len(lane.inflight) < 3:
            self._enqueue_next(lane)  # after forward: on a GPU the copy does not compete with lookups
        if nxt is not None and not input_dist.wait_splits(nxt, lane):  # a no-op after early splits
            nxt = None  # the ranks dropped it (its status rode on its splits)
        self._after_forward(ctx, nxt, losses)
        if losses is not None:
            self._backward_and_optimizer(ctx, losses)
        lane.inflight.popleft()
        return output

    def _step_begins(self, ctx: BatchContext) -> None:
        """First hook, before the copy of batch i+2 (`ctx`: batch i): `clear_data_dist_inputs` frees."""
        if self._clear_data_dist_inputs:
            self._input_dist.release_inputs(ctx)

    def _before_forward(self, ctx: BatchContext, nxt: BatchContext | None) -> None:
        """Hook once input_dist of batch i+1 (`nxt`, None if none) started, before `ctx` is waited for."""

    def _after_forward(self, ctx: BatchContext, nxt: BatchContext | None, losses: Any) -> None:
        """Hook after forward of `ctx` and the splits wait of `nxt` (None: dropped); `losses` None in eval."""

    def _backward_and_optimizer(self, ctx: BatchContext, losses: Any) -> None:
        """In training: backward of `ctx`'s batch, the replicas' sync, the optimizer step."""
        self._backward_stage(ctx, losses)
        if self._dmp_collection_sync_interval_batches is not None:
            self._sync_replicas(ctx)
        with run_stage(self._streams, "optimizer", ctx.index):  # `_optimizer_stage`, without a call
            self._optimizer_step()

    _enqueue_next = PipelineCore._enqueue
    """How the step copies batch i+2: `_enqueue` (`TrainPipelineSparseDistT` dispatches it elsewhere)."""

    def _wait_for_batch(self) -> None:
        """torchrec's subclass point: make the head batch usable on the caller's stream, before forward."""
        if not self._streams.in_order:  # else nothing to wait for (`_wait_copied`)
            self._wait_copied(self._lane.inflight[0].batch)

    # -- torchrec's methods, over our components ------------------------------------------------------

    @property
    def contexts(self) -> deque[BatchContext]:
        """The contexts of the lane in use, oldest first: the deque torchrec's two deques map onto."""
        return self._lane.inflight if self._lane is not None else deque()

    @property
    def batches(self) -> Batches:
        """The batches of `contexts` (read-only)."""
        return Batches(self.contexts)

    @property
    def _pipelined_modules(self) -> list[nn.Module]:
        """The sharded modules whose input_dist runs ahead (none before the first batch)."""
        return [pm.module for pm in self._input_dist.modules]

    @property
    def _model_attached(self) -> bool:
        """The sharded modules' forwards are rewritten (False before the first batch and after `detach()`)."""
        return self._input_dist.rewrite is not None

    def fill_pipeline(self, dataloader_iter: Iterator[Any]) -> None:
        """Put in flight what the next step needs (a no-op once full); the module context is batch i's."""
        lane = self._enter(dataloader_iter)
        self._fill(lane)
        if lane.inflight:
            self._set_module_context(lane.inflight[0])

    def enqueue_batch(self, dataloader_iter: Iterator[Any]) -> bool:
        """Fetch the next batch, copy it to the device and add it to `batches` and `contexts`.

        Returns:
            Whether a batch was added (a rank whose data ended adds a placeholder, None in `batches`).

        Raises:
            StopIteration: the data ended and `execute_all_batches` is False (torchrec's rule).
        """
        copy = self.inplace_copy_batch_to_gpu if self._inplace_copy else self.copy_batch_to_gpu
        batch, context = copy(dataloader_iter)  # enters the iterator's lane
        if context is None:
            return False
        self.contexts.append(context)
        return batch is not None

    def dequeue_batch(self) -> None:
        """Pop the head batch (its backward queued), releasing its hand-offs; set the next one's context."""
        contexts = self.contexts
        self._streams.release(contexts.popleft())
        self._input_dist.slot.current = contexts[0] if contexts else None

    def copy_batch_to_gpu(self, dataloader_iter: Iterator[Any]) -> tuple[Any, BatchContext | None]:
        """Fetch the next batch and copy it to the device, in a new context not added to `contexts`.

        Returns:
            `(batch, context)`: batch None where this rank's data ended, context None: nothing added.

        Raises:
            StopIteration: the data ended and `execute_all_batches` is False.
        """
        return self._copy(dataloader_iter, in_place=False)

    def inplace_copy_batch_to_gpu(self, dataloader_iter: Iterator[Any]) -> tuple[Any, BatchContext | None]:
        """`copy_batch_to_gpu` with the device copy allocated on the stream that uses it (GPU)."""
        return self._copy(dataloader_iter, in_place=True)

    def _copy(self, dataloader_iter: Iterator[Any], *, in_place: bool) -> tuple[Any, BatchContext | None]:
        context = self._fetch_and_copy(self._enter(dataloader_iter), in_place=in_place)
        batch = context.batch if context is not None else None
        if batch is None and not self._execute_all_batches:
            raise StopIteration
        return batch, context

    def start_sparse_data_dist(self, batch: Any, context: BatchContext) -> None:
        """Start the input all-to-alls of `context`'s batch (the first batch rewrites the model first),
        once the ranks admitted it; a no-op for a None batch, or one the ranks dropped.

        Raises:
            ValueError: `batch` is not `context`'s (pass `self.batches[k], self.contexts[k]`).
        """
        lane = self._lane
        if lane is None or not self._ranks.admit(lane, context) or batch is None:
            return
        if batch is not context.batch:
            raise ValueError(
                "start_sparse_data_dist(batch, context): the input_dist reads the batch of its "
                "context here; pass self.batches[k] with self.contexts[k]"
            )
        self._input_dist.start(context)

    def wait_sparse_data_dist(self, context: BatchContext) -> None:
        """Wait for the splits all-to-alls of `context` and start its values all-to-alls."""
        self._input_dist.wait_splits(context, self._lane)

    def clear_sparse_data_dist_inputs(self, context: BatchContext) -> None:
        """Wait for the values all-to-alls of `context` and free what they sent (`clear_data_dist_inputs`)."""
        self._input_dist.release_inputs(context)

    def _set_module_context(self, context: BatchContext) -> None:
        """Make the hijacked forwards read `context` (the batch whose forward runs next)."""
        self._input_dist.slot.current = context

    def register_backward_hook(self, site: InjectionSite, work: Callable[[Any], None]) -> None:
        """Run `work(self)` during each backward at `site` (ours or torchrec's `InjectionSite`, the FQN as
        the user's model names it), for the pipeline's life, as torchrec's."""
        label_text = f"pipeline::backward_hook::{site.fqn}"

        def run(grad: Any) -> None:
            with label(label_text):
                work(self)

        register_backward_hook(site, unwrap_model(self._model), run)


class Batches(Sequence[Any]):
    """torchrec's `batches`, of `contexts`: oldest first, a placeholder None, a worker's copy waited for."""

    __slots__ = ("_contexts",)

    def __init__(self, contexts: deque[BatchContext]) -> None:
        self._contexts = contexts

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self._batch(c) for c in list(self._contexts)[i]]
        return self._batch(self._contexts[i])

    @staticmethod
    def _batch(context: BatchContext) -> Any:
        context.wait_copy()
        return context.batch

    def __len__(self) -> int:
        return len(self._contexts)


class TrainPipelineSparseDistLite(TrainPipelineSparseDist):
    """Only the copy of batch i+1 overlaps the step of i (issued before its backward; torchrec's, after);
    input_dist of i runs before its forward, on the caller's stream: the memory of one batch. Every
    batch runs; numerics: the plain loop's, bit for bit.

    Args (torchrec's, in its order):
        model: usually a DistributedModelParallel; returns `(loss, output)` in training mode.
        optimizer: stepped after each batch's backward.
        device: where batches are copied to.
        apply_jit: not supported; must be False.
        context_type: accepted, unused.
        pipeline_postproc: run parameter-free modules that transform the batch ahead with input_dist.
        custom_model_fwd: called with the batch instead of `model`.
        enable_inplace_copy_batch: allocate the device copy on the stream that uses it (GPU).
        free_features_storage_early: free a batch's KJT storage once every module has its copy.
        clear_data_dist_inputs: free what the input all-to-alls sent before forward (torchrec's: nothing).
        async_inplace_copy: accepted, no effect.

    Keyword-only, ours:
        strict: fail on the first batch if a sharded module cannot be pipelined.
        rewrite: how the sharded modules' inputs are found (`RewriteOptions`).
        input_dist: the width of the ids sent (`InputDistOptions`); the schedule is "late".
        ranks: how the ranks agree on every batch, and fail (`RankOptions`).
        streams: None: a memcpy stream on a GPU, none on CPU.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        apply_jit: bool = False,
        context_type: type[BatchContext] = TrainPipelineContext,
        pipeline_postproc: bool = False,
        custom_model_fwd: Callable[[Any], tuple[torch.Tensor, Any]] | None = None,
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
            dmp_collection_sync_interval_batches=None,  # torchrec's class never syncs replicas
            enable_inplace_copy_batch=enable_inplace_copy_batch,
            free_features_storage_early=free_features_storage_early,
            clear_data_dist_inputs=clear_data_dist_inputs,
            strict=strict,
            rewrite=rewrite,
            input_dist=replace(input_dist or InputDistOptions(), schedule="late"),  # no next batch
            ranks=ranks,
            streams=streams if streams is not None else streams_for(device, data_dist=False),
            lookahead=0,
            riding=False,  # it admits batches itself
        )

    def _fill(self, lane: Lane) -> None:
        """Batch i copied and admitted by the ranks."""
        if not lane.inflight:
            self._enqueue(lane)
        if lane.inflight:
            self._ranks.admit(lane, lane.inflight[0])  # a batch the ranks drop leaves the lane

    def _wait_for_batch(self) -> None:
        """Lite's own, as torchrec's: a patch of the parent's `_wait_for_batch` does not reach Lite."""
        self._wait_copied(self._lane.inflight[0].batch)

    def _step(self, lane: Lane) -> Any:
        ctx, input_dist = lane.inflight[0], self._input_dist
        self._state = PipelineState.IDLE
        self._wait_for_batch()
        input_dist.start(ctx)  # in the critical path: the step waits for it
        input_dist.wait_splits(ctx, lane)
        input_dist.release_inputs(ctx)
        self._state = PipelineState.CALL_FWD
        losses, output = self._forward(ctx, train=True, input_dist=input_dist)
        if len(lane.inflight) < 2:
            self._enqueue(lane)  # the copy of i+1
        if losses is not None:
            self._state = PipelineState.CALL_BWD
            self._backward_stage(ctx, losses)
            self._optimizer_stage(ctx)
        lane.inflight.popleft()
        return output


class EvalPipelineSparseDist(TrainPipelineSparseDist):
    """Forward-only pipeline: input_dist of batch i+1 and the copy of batch i+2 overlap forward of i.

    Each output is bit for bit `model(batch)` under `no_grad`, in the model's mode as it is (call
    `model.eval()` first, as in torchrec); `progress()` returns `output` of a `(loss, output)` pair,
    or any other return value as it is.

    Args (torchrec's, in its order):
        model: the model, run forward only.
        optimizer: not used.
        device: where batches are copied to.
        apply_jit: not supported; must be False.
        pipeline_postproc: run parameter-free modules that transform the batch ahead with input_dist.
        enable_inplace_copy_batch: allocate the device copy on the stream that uses it (GPU).
        free_features_storage_early: free a batch's KJT storage once every module has its copy.
        clear_data_dist_inputs: free what the input all-to-alls sent before forward.

    Keyword-only, ours (as in `TrainPipelineSparseDist`):
        strict: fail on the first batch if a sharded module cannot be pipelined.
        rewrite: how the sharded modules' inputs are found (`RewriteOptions`).
        input_dist: None: `InputDistOptions(schedule="early-shared")`, i+1's values during forward of i.
        ranks: how the ranks agree on every batch, and fail (`RankOptions`).
        streams: the streams to run on; None: CUDA streams on a GPU, none on CPU.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        device: torch.device,
        apply_jit: bool = False,
        pipeline_postproc: bool = False,
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
            apply_jit=apply_jit,
            pipeline_postproc=pipeline_postproc,
            enable_inplace_copy_batch=enable_inplace_copy_batch,
            free_features_storage_early=free_features_storage_early,
            clear_data_dist_inputs=clear_data_dist_inputs,
            strict=strict,
            rewrite=rewrite,
            input_dist=input_dist or InputDistOptions(schedule="early-shared"),
            ranks=ranks,
            streams=streams,
            lookahead=0,
            forward_only=True,
        )
