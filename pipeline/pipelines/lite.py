"""TrainPipelineSparseDistLite: one batch in flight besides the one that trains (the copy of the next
overlaps the current step; each batch's input_dist runs right before its forward): the memory of one
batch and one set of input all-to-alls, for a step that waits on its input_dist. On CUDA its
input_dist runs on the caller's stream, as torchrec's does (no data_dist stream, whose memory pool
would hold another batch's worth).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from pipeline.compat.types import PipelineState
from pipeline.config import InputDistOptions, RankOptions, RewriteOptions
from pipeline.pipelines.sparse_dist import TrainPipelineSparseDist
from pipeline.ranks import Lane
from pipeline.stages.context import BatchContext, TrainPipelineContext
from pipeline.stages.streams import Streams
from pipeline.stages.thread_streams import streams_for

__all__ = ["TrainPipelineSparseDistLite"]


class TrainPipelineSparseDistLite(TrainPipelineSparseDist):
    """The copy of batch i+1 overlaps the step of batch i; input_dist of i runs before forward of i.

    Per `progress()` call that returns batch i: input_dist of i (its splits all-to-all, waited, then
    its values all-to-all, waited by forward), forward of i, the copy of i+1 (torchrec copies after
    backward; here before it, so that on CUDA the copy overlaps backward and, across ranks,
    backward's all-to-all orders the ranks after the fetch: no vote per batch), backward,
    optimizer. Numerics: the plain loop's, bit for bit. Every batch runs (torchrec's class forces
    `execute_all_batches`); `_state` follows torchrec's `PipelineState` (IDLE, CALL_FWD, CALL_BWD).

    Args (torchrec's, in its order):
        model, optimizer, device: as in `TrainPipelineSparseDist`.
        apply_jit: not supported; must be False.
        context_type: accepted, unused (the per-batch contexts are internal).
        pipeline_postproc, custom_model_fwd, enable_inplace_copy_batch,
            free_features_storage_early: as in `TrainPipelineSparseDist`.
        clear_data_dist_inputs: free what the input all-to-alls sent once forward may start
            (torchrec's class accepts it and frees nothing in its step).
        async_inplace_copy: accepted (torchrec 1.9 added it), no effect: our copy is dispatched
            on the caller's thread.

    Keyword-only, ours: as in `TrainPipelineSparseDist`, less the input_dist schedule (no next
    batch: nothing to schedule); `streams` None: a memcpy stream on a GPU (input_dist on the
    caller's stream), none on CPU.
    """

    _status_rides_splits = False  # it admits batches itself

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
        rewrite_method: str | None = None,
        arg_paths: dict[str, Any] | None = None,
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
            dmp_collection_sync_interval_batches=None,  # torchrec's class never syncs replicas
            input_dist=InputDistOptions(schedule="late"),  # no next batch: nothing to schedule
            streams=streams if streams is not None else streams_for(device, data_dist=False),
            lookahead=0,
        )

    def _fill(self, lane: Lane) -> None:
        """Batch i copied and admitted by the ranks (its input_dist is its first collective)."""
        if not lane.inflight:
            self._enqueue(lane)
        if lane.inflight:
            self._ranks.admit(lane, lane.inflight[0])  # a batch the ranks drop leaves the lane

    def _wait_for_batch(self) -> None:
        """Make the head batch, copied on the memcpy stream, usable on the caller's. torchrec's Lite
        overrides its parent's (it has no data_dist stream to wait on), so ours does too: a patch
        of `TrainPipelineSparseDist._wait_for_batch` does not reach Lite there, nor here."""
        self._wait_copied(self._ranks.lane.inflight[0].batch)

    def _step(self, lane: Lane) -> Any:
        ctx, input_dist = lane.inflight[0], self._input_dist
        self._state = PipelineState.IDLE
        self._wait_for_batch()
        input_dist.start(ctx)  # in the critical path: the step waits for it
        input_dist.wait_splits(ctx)
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
