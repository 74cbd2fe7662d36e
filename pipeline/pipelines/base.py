"""TrainPipelineBase: the host-to-device copy of batch i+1 overlaps the compute of batch i."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pipeline.options import RankOptions
from pipeline.pipelines.core import PipelineCore
from pipeline.ranks import Lane
from pipeline.stages.streams import Streams

__all__ = ["TrainPipelineBase"]


class TrainPipelineBase(PipelineCore):
    """Overlaps the host-to-device copy of batch i+1 with forward/backward/optimizer of batch i.

    Args (torchrec's, in its order):
        model: in training mode `model(batch)` returns `(loss, output)`; `progress()` returns `output`.
        optimizer: stepped after each training batch's backward.
        device: where batches are copied to.
        custom_model_fwd: called with the batch instead of `model`.
        enable_inplace_copy_batch: allocate a batch's device copy on the stream that uses it (GPU).

    Keyword-only, ours:
        execute_all_batches: accepted; every batch runs either way (torchrec's Base has no such option).
        streams: the streams to run on; None: CUDA streams on a GPU, none on CPU.
        ranks: how the ranks agree on every batch, and fail (`RankOptions`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        custom_model_fwd: Callable[[Any], tuple[torch.Tensor, Any]] | None = None,
        enable_inplace_copy_batch: bool = False,
        *,
        execute_all_batches: bool = True,
        streams: Streams | None = None,
        ranks: RankOptions | None = None,
    ) -> None:
        super().__init__(
            model,
            optimizer,
            device,
            execute_all_batches=execute_all_batches,
            custom_model_fwd=custom_model_fwd,
            streams=streams,
            ranks=ranks,
            enable_inplace_copy_batch=enable_inplace_copy_batch,
        )

    def _fill(self, lane: Lane) -> None:
        if not lane.inflight:
            self._enqueue(lane)
        if lane.inflight:
            self._ranks.admit(lane, lane.inflight[0])  # forward is the first collective

    def _step(self, lane: Lane) -> Any:
        ctx = lane.inflight[0]
        self._enqueue(lane)  # copy of i+1 overlaps compute of i
        self._wait_for_batch(ctx.batch)
        losses, output = self._forward(ctx, train=True)
        if losses is not None:
            self._backward_stage(ctx, losses)
            self._optimizer_stage(ctx)
        lane.inflight.popleft()
        return output

    def _wait_for_batch(self, cur_batch: Any) -> None:
        """Make `cur_batch`, copied to the device on the memcpy stream, usable on the caller's
        (torchrec's subclass point, with its signature on this class); called before forward."""
        self._wait_copied(cur_batch)
