"""The pipelines that look a batch up ahead of its forward (`pipeline.stages.lookup`): Fused, EvalFused
and PEC at the start of its step, by SparseDist's hooks; SemiSync a step earlier, in a step of its own."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from pipeline.options import InputDistOptions, RankOptions, RewriteOptions
from pipeline.pipelines.sparse_dist import TrainPipelineSparseDist
from pipeline.ranks import Lane
from pipeline.stages.context import BatchContext, LookupBatchContext
from pipeline.stages.lookup import LookupStage
from pipeline.stages.streams import Streams

try:
    from torchrec.distributed.pec_embedding import ShardedPECEmbeddingCollection
except ImportError:  # a torchrec without PEC modules
    ShardedPECEmbeddingCollection = None

__all__ = [
    "LOOKUP_STREAMS",
    "EvalPipelineFusedSparseDist",
    "TrainPipelineFusedSparseDist",
    "TrainPipelinePEC",
    "TrainPipelineSemiSync",
    "pec_modules",
]

logger = logging.getLogger(__name__)

LOOKUP_STREAMS = ("data_dist", "new", "current")


def _lookup_stream(emb_lookup_stream: str) -> bool:
    """Whether the lookup runs on the caller's stream; a ValueError if not one of `LOOKUP_STREAMS`."""
    if emb_lookup_stream not in LOOKUP_STREAMS:
        raise ValueError(f"emb_lookup_stream must be one of {LOOKUP_STREAMS}; got {emb_lookup_stream!r}")
    return emb_lookup_stream == "current"


class TrainPipelineFusedSparseDist(TrainPipelineSparseDist):
    """SparseDist whose embedding lookup of batch i runs at the start of step i, ahead of forward: the
    plain loop's numbers, bit for bit (where the dense optimizer steps a sharded module's parameters,
    the lookup waits for that step; torchrec's does not).

    Args (torchrec's, in its order; the others, and ours, keyword-only, as in `TrainPipelineSparseDist`):
        emb_lookup_stream: "data_dist" or "new": on the data_dist stream; "current": the caller's.
        embedding_lookup_after_data_dist: look i up after the input_dist start of i+1, not first.

    Raises:
        ValueError: `emb_lookup_stream` is not one of `LOOKUP_STREAMS`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        pipeline_postproc: bool = True,
        custom_model_fwd: Callable[[Any], tuple[torch.Tensor, Any]] | None = None,
        strict: bool = False,
        emb_lookup_stream: str = "data_dist",
        embedding_lookup_after_data_dist: bool = False,
        enable_inplace_copy_batch: bool = False,
        enqueue_batch_after_forward: bool = False,
        free_features_storage_early: bool = False,
        clear_data_dist_inputs: bool = False,
        *,
        rewrite: RewriteOptions | None = None,
        input_dist: InputDistOptions | None = None,
        ranks: RankOptions | None = None,
        streams: Streams | None = None,
    ) -> None:
        on_caller = _lookup_stream(emb_lookup_stream)
        self._setup(
            model,
            optimizer,
            device,
            execute_all_batches=execute_all_batches,
            apply_jit=apply_jit,
            pipeline_postproc=pipeline_postproc,
            custom_model_fwd=custom_model_fwd,
            enqueue_batch_after_forward=enqueue_batch_after_forward,
            enable_inplace_copy_batch=enable_inplace_copy_batch,
            free_features_storage_early=free_features_storage_early,
            clear_data_dist_inputs=clear_data_dist_inputs,
            strict=strict,
            rewrite=rewrite,
            input_dist=input_dist,
            ranks=ranks,
            streams=streams,
            forward="lookup",
            context_type=LookupBatchContext,
        )
        self._lookup = LookupStage(
            self._streams, self._input_dist, model, optimizer, on_caller_stream=on_caller
        )
        self._lookup_first = not embedding_lookup_after_data_dist

    def start_embedding_lookup(self, batch: Any, context: BatchContext) -> None:
        """Look `context`'s batch up for its forward (a no-op for a None batch or once done)."""
        if batch is not None:
            self._lookup.run(context)

    def wait_embedding_lookup(self) -> None:
        """Order the caller's stream after the lookups started so far."""
        self._lookup.wait()

    def _step_begins(self, ctx: BatchContext) -> None:
        if self._lookup_first:
            self._lookup.run(ctx)

    def _before_forward(self, ctx: BatchContext, nxt: BatchContext | None) -> None:
        self._lookup.run(ctx)  # a no-op when it ran first

    def _backward_and_optimizer(self, ctx: BatchContext, losses: Any) -> None:
        self._lookup.backward_and_step(
            losses, lambda losses: self._backward_stage(ctx, losses), lambda: self._optimizer_stage(ctx)
        )


class EvalPipelineFusedSparseDist(TrainPipelineFusedSparseDist):
    """Forward-only `TrainPipelineFusedSparseDist`: each output is the model's own under `no_grad`.

    Args (torchrec's, in its order, then its keyword; the others as in `TrainPipelineFusedSparseDist`,
    `optimizer` unused; ours, keyword-only, as in `EvalPipelineSparseDist`):
        enqueue_batch_after_forward: accepted; batch i+2 is copied before forward, as by torchrec's.
        enable_embedding_lookup_prefetch: look batch i+1 up right after forward of i.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        device: torch.device,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        pipeline_postproc: bool = True,
        custom_model_fwd: Callable[[Any], tuple[torch.Tensor, Any]] | None = None,
        strict: bool = False,
        emb_lookup_stream: str = "data_dist",
        embedding_lookup_after_data_dist: bool = False,
        enable_inplace_copy_batch: bool = False,
        enqueue_batch_after_forward: bool = False,
        free_features_storage_early: bool = False,
        clear_data_dist_inputs: bool = False,
        *,
        enable_embedding_lookup_prefetch: bool = False,
        rewrite: RewriteOptions | None = None,
        input_dist: InputDistOptions | None = None,
        ranks: RankOptions | None = None,
        streams: Streams | None = None,
    ) -> None:
        on_caller = _lookup_stream(emb_lookup_stream)
        self._setup(
            model,
            optimizer,
            device,
            execute_all_batches=execute_all_batches,
            apply_jit=apply_jit,
            pipeline_postproc=pipeline_postproc,
            custom_model_fwd=custom_model_fwd,
            enqueue_batch_after_forward=enqueue_batch_after_forward,
            enable_inplace_copy_batch=enable_inplace_copy_batch,
            free_features_storage_early=free_features_storage_early,
            clear_data_dist_inputs=clear_data_dist_inputs,
            strict=strict,
            rewrite=rewrite,
            input_dist=input_dist or InputDistOptions(schedule="early-shared"),
            ranks=ranks,
            streams=streams,
            forward="lookup",
            context_type=LookupBatchContext,
            forward_only=True,
        )
        self._lookup = LookupStage(
            self._streams, self._input_dist, model, optimizer, on_caller_stream=on_caller, forward_only=True
        )
        self._lookup_ahead = enable_embedding_lookup_prefetch
        self._lookup_first = enable_embedding_lookup_prefetch or not embedding_lookup_after_data_dist

    def _after_forward(self, ctx: BatchContext, nxt: BatchContext | None, losses: Any) -> None:
        if nxt is not None and self._lookup_ahead:
            self._lookup.run(nxt)


class TrainPipelinePEC(TrainPipelineSparseDist):
    """SparseDist whose embedding lookup of batch i runs at the top of step i (torchrec 1.9's;
    docs/reference.md, "TrainPipelinePEC"); PEC modules are looked up whole, without torchrec's split of
    their ids, and `rewrite_report` says so. Args: `TrainPipelineSparseDist`'s."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        custom_model_fwd: Callable[[Any], tuple[torch.Tensor, Any]] | None = None,
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
            pipeline_postproc=False,  # as torchrec's class: SparseDist's default
            custom_model_fwd=custom_model_fwd,
            strict=strict,
            rewrite=rewrite,
            input_dist=input_dist,
            ranks=ranks,
            streams=streams,
            forward="lookup",
            context_type=LookupBatchContext,
        )
        self._lookup = LookupStage(self._streams, self._input_dist, model, optimizer)
        self._noted = False

    def _fill(self, lane: Lane) -> None:
        self._input_dist.fill(lane, self._enqueue)
        rewrite = self._input_dist.rewrite
        if not self._noted and rewrite is not None and not rewrite.needs_recording:
            self._noted = True
            pec = pec_modules(self._model)
            if pec:
                rewrite.report.notes.append(
                    f"PEC modules {', '.join(pec)}: looked up whole at the top of the step, as the "
                    "other sharded modules (the plain loop's numbers); torchrec's split of their ids "
                    "by recurrence in the next batch is not implemented here"
                )

    def _step_begins(self, ctx: BatchContext) -> None:
        self._lookup.run(ctx)

    _backward_and_optimizer = TrainPipelineFusedSparseDist._backward_and_optimizer


class TrainPipelineSemiSync(TrainPipelineSparseDist):
    """SparseDist whose embedding lookup of batch i+1 runs before backward of i, from `start_batch` on,
    so it reads embeddings one update stale (torchrec 1.8's semi-synchronous training; docs/reference.md,
    "TrainPipelineSemiSync"). A pipelined module whose parameters the dense optimizer steps changes after
    the next lookup used it: a warning (an error under `strict`).

    Args (torchrec's, in its order; the others, and ours, keyword-only, as in `TrainPipelineSparseDist`;
    `execute_all_batches=False` drops nothing, as torchrec's):
        start_batch: index (an int >= 0) of the first batch whose successor is looked up before its backward.
        stash_gradients: step the dense optimizer on the previous batch's gradients ("true" semi-sync).

    Raises:
        ValueError: `start_batch` is not an int >= 0.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        start_batch: int = 900,
        stash_gradients: bool = False,
        pipeline_postproc: bool = True,
        custom_model_fwd: Callable[[Any], tuple[torch.Tensor, Any]] | None = None,
        strict: bool = False,
        dmp_collection_sync_interval_batches: int | None = 1,
        enable_inplace_copy_batch: bool = False,
        free_features_storage_early: bool = False,
        clear_data_dist_inputs: bool = False,
        *,
        rewrite: RewriteOptions | None = None,
        input_dist: InputDistOptions | None = None,
        ranks: RankOptions | None = None,
        streams: Streams | None = None,
    ) -> None:
        if not isinstance(start_batch, int) or start_batch < 0:
            raise ValueError(f"start_batch must be an int >= 0; got {start_batch!r}")
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
            forward="lookup",
            context_type=LookupBatchContext,
            lookahead=0,
            riding=False,  # it admits batches itself
        )
        self._lookup = LookupStage(self._streams, self._input_dist, model, optimizer)
        self._start_batch = start_batch
        self._stash = stash_gradients
        self._stashed: dict[str, torch.Tensor] = {}
        self._strict_sharing = strict
        self._checked_sharing = False

    def is_semi_sync(self) -> bool:
        """Whether the head batch is past `start_batch`: its successor is looked up before its backward."""
        contexts = self.contexts
        return bool(contexts) and contexts[0].index >= self._start_batch

    def embedding_backward(self, context: BatchContext) -> None:
        """Nothing to do: backward already reached the embeddings (the lookup's output is not detached)."""

    def extract_model_input_from_batch(self, batch: Any) -> Any:
        """The batch itself: the input_dist reads the modules' inputs at the paths the rewrite found."""
        return batch

    start_embedding_lookup = TrainPipelineFusedSparseDist.start_embedding_lookup

    def _fill(self, lane: Lane) -> None:
        for k in range(2):  # batches i and i+1
            if not self._start(lane, k):
                return
            self._input_dist.wait_splits(lane.inflight[k], lane)

    def _start(self, lane: Lane, k: int) -> bool:
        """Start input_dist of the k-th batch in flight, after fetching k+1; False if there is none."""
        while len(lane.inflight) < k + 2 and self._enqueue(lane):
            pass
        if len(lane.inflight) <= k:
            return False
        ctx = lane.inflight[k]
        if not ctx.started:
            if not self._ranks.admit(lane, ctx):
                return False
            self._input_dist.start(ctx)
        return True

    def _step(self, lane: Lane) -> Any:
        ctx = lane.inflight[0]
        input_dist, lookup = self._input_dist, self._lookup
        training = self._model.training
        input_dist.choose_schedule(training)
        semi = training and ctx.index >= self._start_batch
        self._check_sharing()
        lookup.run(ctx)  # the first batch; later ones were looked up in the step before
        third = lane.inflight[2] if self._start(lane, 2) else None
        if third is not None and input_dist.early_splits:
            input_dist.wait_splits(third, lane)
        self._wait_for_batch()
        losses, output = self._forward(ctx, train=True, input_dist=input_dist)
        nxt = lane.inflight[1] if len(lane.inflight) > 1 else None
        if nxt is not None and semi:
            lookup.run(nxt)  # before the embedding update of batch i: one step stale
        if third is not None:
            input_dist.wait_splits(third, lane)
        if losses is not None:
            lookup.backward_and_step(
                losses, lambda losses: self._backward_and_sync(ctx, losses), lambda: self._stashed_step(ctx)
            )
        if nxt is not None and not semi:
            lookup.run(nxt)
        lane.inflight.popleft()
        return output

    def _backward_and_sync(self, ctx: BatchContext, losses: Any) -> None:
        self._backward_stage(ctx, losses)
        self._sync_replicas(ctx)

    def _stashed_step(self, ctx: BatchContext) -> None:
        """The optimizer step; with `stash_gradients`, on the previous batch's gradients: this batch's
        are stashed in their place."""
        if self._stash and ctx.index >= self._start_batch:
            for name, param in self._model.named_parameters():
                # as torchrec: a parameter without a gradient this step keeps its stash for the next
                previous = self._stashed.get(name)
                if param.grad is not None:
                    self._stashed[name] = param.grad.clone()
                param.grad = previous
            if ctx.index == self._start_batch:
                return  # no stashed gradients yet
        self._optimizer_stage(ctx)

    def _check_sharing(self) -> None:
        if self._checked_sharing or self._input_dist.rewrite is None:
            return
        self._checked_sharing = True
        if self._lookup.shares_optimizer():
            message = (
                "TrainPipelineSemiSync: a pipelined sharded module has parameters in the dense "
                "optimizer (e.g. feature processors); they change after the next batch's lookup "
                "used them, which autograd rejects or which trains on stale values"
            )
            if self._strict_sharing:
                raise ValueError(message)
            logger.warning(message)


def pec_modules(model: torch.nn.Module) -> list[str]:
    """The FQNs of the `ShardedPECEmbeddingCollection`s in `model` (none where torchrec has none)."""
    if ShardedPECEmbeddingCollection is None:
        return []
    return [fqn for fqn, m in model.named_modules() if isinstance(m, ShardedPECEmbeddingCollection)]
