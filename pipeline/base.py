"""TrainPipelineBase, and the machinery every pipeline shares: lanes of in-flight batches, the copy
stage and the forward/backward/optimizer stages.

Stages of TrainPipelineBase, per `progress()` call that returns batch i:

| stage              | stream (CUDA)      | batch |
|--------------------|--------------------|-------|
| copy host->device  | memcpy             | i+1   |
| forward            | current            | i     |
| backward           | current            | i     |
| optimizer          | current            | i     |

Batches are kept per dataloader iterator (a "lane"): calling `progress()` with another iterator (an
eval loader, say) parks the in-flight batches of the first one, and calling it again with the first
resumes them, so no batch is lost, repeated or run in the other loader's loop.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pipeline.batch import to_device
from pipeline.context import BatchContext
from pipeline.labels import stage
from pipeline.streams import Streams, streams_for

__all__ = ["TrainPipelineBase"]


@dataclass(eq=False)
class _Lane:
    iterator: Iterator[Any]
    inflight: deque[BatchContext] = field(default_factory=deque)
    exhausted: bool = False
    steps: int = 0
    """Batches of this iterator run so far."""


class TrainPipelineBase:
    """Overlaps the host-to-device copy of batch i+1 with forward/backward/optimizer of batch i.

    Args:
        model: the model; in training mode `model(batch)` returns `(loss, output)`. In eval mode
            `progress()` returns `output` of a `(loss, output)` pair, or whatever else it returns.
        optimizer: stepped after each training batch's backward.
        device: where batches are copied to.
        custom_model_fwd: called with the batch instead of `model` (same return convention).
        execute_all_batches: when the dataloader is exhausted, run the batches already in flight
            (True) or, as torchrec's pipelines do, drop them (False): a step runs only if the batch
            that torchrec's pipeline of the same name fetches during that step exists
            (`_lookahead`). TrainPipelineBase drops nothing, as torchrec's Base, which has no such
            option, runs every batch.
        streams: stream implementation; default: real streams on CUDA, none on CPU. Tests pass
            `RecordingStreams()` to check every cross-stream hand-off.
    """

    _context_type: type[BatchContext] = BatchContext
    _prefetch_thread = False  # on CPU, run the prefetch stage on a worker thread

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        custom_model_fwd: Callable[[Any], Any] | None = None,
        *,
        execute_all_batches: bool = True,
        streams: Streams | None = None,
    ) -> None:
        self._model = model
        self._optimizer = optimizer
        self._device = device
        self._model_fwd = custom_model_fwd if custom_model_fwd is not None else model
        self._execute_all_batches = execute_all_batches
        self._streams = (
            streams if streams is not None else streams_for(device, prefetch_thread=self._prefetch_thread)
        )
        self._lanes: dict[int, _Lane] = {}
        self._next_index = 0

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """Run one batch through forward (and, in training mode, backward and optimizer).

        Returns:
            The model's output for the oldest batch in flight from `dataloader_iter`.

        Raises:
            StopIteration: every batch of `dataloader_iter` has been processed.
        """
        lane = self._lanes.get(id(dataloader_iter))
        if lane is None or lane.iterator is not dataloader_iter:
            lane = self._lanes[id(dataloader_iter)] = _Lane(dataloader_iter)
        try:
            if not self._execute_all_batches and not self._read_ahead(lane):
                lane.inflight.clear()  # the dataloader ended before this step's look-ahead: drop all
            self._fill(lane)
            if not lane.inflight:
                del self._lanes[id(dataloader_iter)]
                raise StopIteration
            output = self._step(lane)
            lane.steps += 1
            return output
        except StopIteration:
            raise
        except BaseException:
            self.reset()
            raise

    def reset(self) -> None:
        """Drop every in-flight batch (after an exception, or to abandon an iterator)."""
        self._streams.drain()
        self._lanes.clear()

    # -- execute_all_batches=False ------------------------------------------------------------

    def _lookahead(self, lane: _Lane) -> int:
        """Under `execute_all_batches=False`, the head batch runs only if this many batches follow
        it in the dataloader (torchrec's rule for the pipeline of the same name)."""
        return 0

    def _read_ahead(self, lane: _Lane) -> bool:
        """Copy batches until `_lookahead` batches follow the head; False if the dataloader ends
        first. Only copies: nothing is started on the batches that may be dropped."""
        while len(lane.inflight) <= self._lookahead(lane):
            if not self._enqueue(lane):
                return False
        return True

    # -- stages shared by all pipelines -------------------------------------------------------

    def _enqueue(self, lane: _Lane) -> bool:
        """Fetch the next batch and start copying it; False when the iterator is exhausted."""
        if lane.exhausted:
            return False
        try:
            batch = next(lane.iterator)
        except StopIteration:
            lane.exhausted = True
            return False
        ctx = self._context_type(index=self._next_index, streams=self._streams)
        self._next_index += 1
        with stage(self._streams, "copy", ctx.index, self._streams.memcpy):
            ctx.batch = to_device(batch, self._device, non_blocking=True)
            self._streams.produced(ctx.batch)
        lane.inflight.append(ctx)
        return True

    def _forward(self, ctx: BatchContext) -> tuple[Any, Any]:
        """Forward of `ctx`'s batch; returns `(losses or None, output)`."""
        streams = self._streams
        streams.handoff(ctx.batch, streams.memcpy)
        streams.consumed(ctx.batch)
        training = self._model.training
        if training:
            self._optimizer.zero_grad()
        with stage(streams, "forward", ctx.index), torch.set_grad_enabled(training):
            result = self._call_model(ctx)
        if not training:
            # torchrec returns `output` of `(loss, output)` in eval too; any other return value
            # (a model that returns only predictions in eval) is passed through as it is.
            is_pair = isinstance(result, tuple) and len(result) == 2
            return None, result[1] if is_pair else result
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(
                "in training mode the model (or custom_model_fwd) must return (loss, output); got "
                f"{type(result).__name__}. Wrap the model or pass custom_model_fwd."
            )
        return result

    def _call_model(self, ctx: BatchContext) -> Any:
        return self._model_fwd(ctx.batch)

    def _backward_and_step(self, ctx: BatchContext, losses: Any) -> None:
        with stage(self._streams, "backward", ctx.index):
            torch.sum(losses).backward()
        with stage(self._streams, "optimizer", ctx.index):
            self._optimizer.step()

    # -- the schedule -------------------------------------------------------------------------

    def _fill(self, lane: _Lane) -> None:
        if not lane.inflight:
            self._enqueue(lane)

    def _step(self, lane: _Lane) -> Any:
        ctx = lane.inflight[0]
        self._enqueue(lane)  # copy of i+1 overlaps compute of i
        losses, output = self._forward(ctx)
        if losses is not None:
            self._backward_and_step(ctx, losses)
        lane.inflight.popleft()
        return output
