"""TrainPipelineBase: the host-to-device copy of batch i+1 overlaps forward/backward/optimizer of
batch i.

Per `progress()` call that returns batch i:

| stage              | stream (CUDA)      | batch |
|--------------------|--------------------|-------|
| copy host->device  | memcpy             | i+1   |
| forward            | current            | i     |
| backward           | current            | i     |
| optimizer          | current            | i     |
"""

from __future__ import annotations

from typing import Any

from pipeline.compat.signatures import Bound
from pipeline.pipelines.core import LanePipeline
from pipeline.ranks import Lane

__all__ = ["TrainPipelineBase"]


class TrainPipelineBase(LanePipeline):
    """Overlaps the host-to-device copy of batch i+1 with forward/backward/optimizer of batch i.

    Args (torchrec's, in its order, then ours, keyword-only; `pipeline.compat.signatures`):
        model: the model; in training mode `model(batch)` returns `(loss, output)`. In eval mode
            `progress()` returns `output` of a `(loss, output)` pair, or whatever else it returns.
        optimizer: stepped after each training batch's backward.
        device: where batches are copied to.
        custom_model_fwd: called with the batch instead of `model` (same return convention).
        enable_inplace_copy_batch: `MemoryOptions` (GPU only).
        execute_all_batches: ours; torchrec's Base has no such option and runs every batch, and
            so does ours under False (nothing follows the head batch that it would need).
        streams, on_uneven, check_keys, agreement, abort_on_error, failure_grace, peer_timeout:
            the streams (tests pass `pipeline.testing.RecordingStreams()`) and `RankOptions`.
    """

    def _compose(self, bound: Bound) -> None:
        """Nothing beyond the shared stages."""

    def _fill(self, lane: Lane) -> None:
        if not lane.inflight:
            self._enqueue(lane)
        if lane.inflight:
            self._ranks.admit(lane, lane.inflight[0])  # forward is the first collective

    def _step(self, lane: Lane) -> Any:
        ctx = lane.inflight[0]
        self._enqueue(lane)  # copy of i+1 overlaps compute of i
        losses, output = self._forward(ctx, train=True)
        # batch i+1 was fetched before this forward: its flags may be read from the first
        # collective over every rank after it (`Ranks.after_world_collective`)
        read_early = self._ranks.forward_spanned_world(lane, self._model)
        if read_early:
            self._ranks.after_world_collective(lane, 1)
        if losses is not None:
            self._backward(ctx, losses)
        lane.inflight.popleft()
        if not read_early:
            self._ranks.after_world_collective(lane, 0)
        if losses is not None:
            self._optimizer_step(ctx)
        return output
