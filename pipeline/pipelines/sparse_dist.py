"""TrainPipelineSparseDist: input_dist of the next batch runs ahead of forward (stages and streams:
`pipeline.stages`; when the next batch's splits are waited for and on which process group its
all-to-alls run: `pipeline.stages.schedule`; by default the watch of `pipeline.stages.watch`, which
starts in torchrec's order and may move every rank to early where that pays). With
`enqueue_batch_after_forward`, the copy of batch i+2 moves after forward of i, as in torchrec. On
CPU the collectives run in gloo's threads, so the overlap is real there too.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from pipeline.config import InputDistOptions, RankOptions, RewriteOptions
from pipeline.pipelines.input_dist_core import InputDistCore
from pipeline.ranks import Lane
from pipeline.stages.context import BatchContext, TrainPipelineContext
from pipeline.stages.streams import Streams

__all__ = ["TrainPipelineSparseDist"]


class TrainPipelineSparseDist(InputDistCore):
    """Overlaps input_dist of batch i+1 and the copy of batch i+2 with the compute of batch i.

    Args (torchrec's, in its order):
        model: usually a DistributedModelParallel; returns `(loss, output)` in training mode.
        optimizer: stepped after each training batch's backward.
        device: where batches are copied to.
        execute_all_batches: run the batches in flight once the dataloader is exhausted (True), or
            drop the last two as torchrec does (False).
        apply_jit: not supported; must be False.
        context_type: accepted, unused (the per-batch contexts are internal).
        pipeline_postproc: run parameter-free modules that transform the batch ahead with
            input_dist, instead of leaving their sharded consumers unpipelined.
        custom_model_fwd: called with the batch instead of `model`.
        dmp_collection_sync_interval_batches: with a `DMPCollection` (2D sharding), sync its
            replicas after every this many batches; None never. Other models: 1 or None.
        enqueue_batch_after_forward: copy batch i+2 after forward of i instead of before it.
        enable_inplace_copy_batch: allocate the device copy on the stream that uses it (GPU).
        free_features_storage_early: free a batch's KJT storage once every module has its copy.
        clear_data_dist_inputs: free what the input all-to-alls sent before forward.
        async_inplace_copy: accepted (torchrec 1.9 added it), no effect: torchrec dispatches the
            in-place copy from a worker thread on a GPU under it; ours dispatches on the caller's.

    Keyword-only, ours:
        strict: fail on the first batch if a sharded module cannot be pipelined.
        rewrite_method, arg_paths: the fields of `RewriteOptions` (`rewrite` may give them).
        input_dist_schedule, narrow_ids: the fields of `InputDistOptions` (`input_dist` may give
            them).
        streams: the streams to run on; None: CUDA streams on a GPU, none on CPU.
        on_uneven, check_keys, check_kjts, agreement, abort_on_error, failure_grace,
            peer_timeout: the fields of `RankOptions` (`ranks` may give them).
        A keyword left None takes its options object's value, else that dataclass's default.
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
        self._build(locals())

    _enqueue_next = InputDistCore._enqueue
    """How the step copies batch i+2 (a subclass may dispatch it elsewhere: `TrainPipelineSparseDistT`)."""

    def _fill(self, lane: Lane) -> None:
        self._input_dist.fill(lane, self._enqueue)

    def _step(self, lane: Lane) -> Any:
        """The copy of batch i+2 (after forward of i under `enqueue_batch_after_forward`) and the
        input_dist of i+1 overlap forward, backward and optimizer of i. Prefetch runs it too when no
        module has prefetch work."""
        ctx, input_dist = lane.inflight[0], self._input_dist
        copy_late = self._enqueue_batch_after_forward
        input_dist.choose_schedule(self._model.training)
        input_dist.release_inputs(ctx)
        if not copy_late and len(lane.inflight) < 3:
            self._enqueue_next(lane)
        nxt = input_dist.start_next(lane)  # waits for its copy where it was dispatched on a worker
        self._wait_for_batch()
        losses, output = self._forward(ctx, train=True, input_dist=input_dist)
        if copy_late and len(lane.inflight) < 3:
            self._enqueue_next(lane)  # after forward: on a GPU the copy does not compete with lookups
        if nxt is not None:
            input_dist.wait_splits(nxt)  # a no-op after early splits
        if losses is not None:
            self._backward_stage(ctx, losses)
            self._sync_replicas(ctx)
            self._optimizer_stage(ctx)
        lane.inflight.popleft()
        return output

    def _wait_for_batch(self) -> None:
        """Make the head batch (`self.batches[0]`), copied to the device on the memcpy stream,
        usable on the caller's: torchrec's subclass point, with its signature on this family;
        each step calls it before forward."""
        head, streams = self._ranks.lane.inflight[0], self._streams
        # held for the caller's stream on behalf of the head batch, released after its step
        streams.handoff(head.batch, streams.memcpy, head)
        streams.consumed(head.batch)
