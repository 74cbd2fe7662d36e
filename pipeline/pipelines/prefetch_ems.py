"""TrainPipelinePrefetchEMS: TrainPipelineSparseDistEmbStash plus a prefetch stage placed as
torchrec's: after forward of batch i the stashed embedding weights come back and the prefetch of
batch i+1 is submitted, before backward of i (it then overlaps backward: on CUDA on the prefetch
stream, on CPU on a worker thread when a module's `prefetch()` moves data).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from pipeline.compat.backward_injection import InjectionSite
from pipeline.config import InputDistOptions, RankOptions, RewriteOptions
from pipeline.pipelines.emb_stash import TrainPipelineSparseDistEmbStash, hook_embedding_stash
from pipeline.ranks import Lane
from pipeline.stages.context import BatchContext, PrefetchBatchContext, TrainPipelineContext
from pipeline.stages.embedding_stash import EmbeddingStash
from pipeline.stages.prefetch import PrefetchStage
from pipeline.stages.streams import Streams
from pipeline.stages.thread_streams import streams_for

__all__ = ["TrainPipelinePrefetchEMS"]


class TrainPipelinePrefetchEMS(TrainPipelineSparseDistEmbStash):
    """EmbStash plus a prefetch stage: after forward of batch i the stashed weights come back
    and the prefetch of batch i+1 is submitted, before backward of i.

    Numerics: the plain loop's, bit for bit, as the Prefetch pipeline's (the kernel keeps the rows
    of batch i while batch i+1 prefetches). torchrec's class also frees and restores the
    UVM-caching kernels' cache around the dense forward; torchrec's sharded modules (1.9.2) never
    stash a cache, so there it restores nothing, and ours stashes no cache either.

    Args (torchrec's, in its order, then ours, keyword-only): as in `TrainPipelineSparseDistEmbStash`
    (`streams`: on CPU by default a prefetch worker thread, as `PrefetchTrainPipelineSparseDist`'s).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        site_fqn: str | InjectionSite,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        context_type: type[BatchContext] = TrainPipelineContext,
        pipeline_postproc: bool = False,
        custom_model_fwd: Callable[[Any], tuple[torch.Tensor, Any]] | None = None,
        dmp_collection_sync_interval_batches: int | None = 1,
        enqueue_batch_after_forward: bool = False,
        enable_inplace_copy_batch: bool = False,
        free_features_storage_early: bool = False,
        *,
        strict: bool = False,
        rewrite: RewriteOptions | None = None,
        rewrite_method: str | None = None,
        arg_paths: dict[str, Any] | None = None,
        input_dist: InputDistOptions | None = None,
        input_dist_schedule: str | None = None,
        narrow_ids: bool | None = None,
        streams: Streams | None = None,
        ranks: RankOptions | None = None,
        on_uneven: str | None = None,
        check_keys: bool | None = None,
        check_kjts: bool | None = None,
        agreement: bool | None = None,
        abort_on_error: bool | None = None,
        failure_grace: float | None = None,
        peer_timeout: timedelta | None = None,
    ) -> None:
        self._build(
            locals(),
            streams=streams if streams is not None else streams_for(device, prefetch_thread=True),
            forward="prefetch",
            batch_context=PrefetchBatchContext,
        )
        self._prefetch = PrefetchStage(self._streams, self._input_dist, ahead="auto")
        self._emb_stash = EmbeddingStash(self._streams, model, device, delay=False)
        self._on_reset.append(self._emb_stash.finish)
        hook_embedding_stash(model, self._emb_stash, site_fqn, delay=False, stash_site_fqn=None)

    def _step(self, lane: Lane) -> Any:
        ctx = lane.inflight[0]
        input_dist, prefetch, emb_stash = self._input_dist, self._prefetch, self._emb_stash
        input_dist.choose_schedule(self._model.training)
        copy_late = self._enqueue_batch_after_forward
        if not copy_late and len(lane.inflight) < 3:
            self._enqueue(lane)
        nxt = input_dist.start_next(lane)
        prefetch.wait(ctx)  # submitted in the step before (the first batch's: now)
        self._wait_for_batch()
        if self._model.training:
            emb_stash.arm()
        losses, output = self._forward(ctx, train=True, input_dist=input_dist)
        if copy_late and len(lane.inflight) < 3:
            self._enqueue(lane)
        if nxt is not None and not input_dist.wait_splits(nxt):  # a no-op after early splits
            nxt = None  # the ranks dropped it (its status rode on its splits)
        emb_stash.ready()  # before backward, and before the prefetch of i+1 touches the kernels
        if nxt is not None:
            prefetch.submit(nxt)
        if losses is not None:
            self._backward_stage(ctx, losses)
            self._sync_replicas(ctx)
        emb_stash.finish()
        if losses is not None:
            self._optimizer_stage(ctx)
        lane.inflight.popleft()
        return output
