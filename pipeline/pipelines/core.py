"""`PipelineCore`: what every pipeline class shares, and only that: lanes of in-flight batches,
`progress()` / `drain()` / `reset()`, on top of the stages every class runs (copy, forward,
backward, optimizer: `BatchStages`, batch_stages.py).

Lanes: batches are kept per dataloader iterator (`pipeline.ranks.Lane`), so that `progress()` with
another iterator (an eval loader) parks the batches in flight of the first one, and calling it
again with the first resumes them: no batch is lost, repeated or run in the other loader's loop.
Across ranks, every batch is admitted by the ranks' protocol (`pipeline.ranks.Ranks`) before its
first collective.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from pipeline.compat.arguments import sync_interval
from pipeline.compat.types import TrainPipeline
from pipeline.config import RankOptions
from pipeline.pipelines.batch_stages import BatchStages
from pipeline.ranks import AgreedError, Lane, LaneState, Ranks, StopIterationInStepError
from pipeline.ranks.protocol import resume_state
from pipeline.stages.context import BatchContext
from pipeline.stages.streams import Streams
from pipeline.stages.thread_streams import streams_for

__all__ = ["PipelineCore"]

_ENDED = object()
"""What `PipelineCore._advance` returns once the lane is empty (`progress()` then raises
StopIteration: the one StopIteration it lets out)."""


class PipelineCore(BatchStages, TrainPipeline):
    """The machinery every pipeline class shares (a torchrec `TrainPipeline`). A class built on it
    declares its constructor (torchrec's parameters, then ours, keyword-only), calls this one,
    composes its components, and implements `_fill` (what must be in flight before a step) and
    `_step` (one step, calling torchrec's subclass points: `SubclassPoints`, batch_stages.py) in its
    own module.

    Args:
        model: the model the pipeline runs.
        optimizer: stepped after each training batch's backward.
        device: where batches are copied to.
        execute_all_batches: run the batches in flight once the dataloader ends (True), or drop
            the last `lookahead` of them, as torchrec does (False).
        custom_model_fwd: called with the batch instead of `model`.
        streams: the streams to run on; None: real streams on CUDA, none on CPU.
        ranks: how the ranks agree.
        enable_inplace_copy_batch: allocate the device copy on the stream that uses it (GPU).
        dmp_collection_sync_interval_batches: the replicas' sync interval of a `DMPCollection`.
        context_type: the per-batch context the class's stages need.
        lookahead: under `execute_all_batches=False`, the head batch runs only if this many
            batches follow it (torchrec's rule for the class of the same name).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Any,
        device: torch.device,
        *,
        execute_all_batches: bool,
        custom_model_fwd: Callable[[Any], Any] | None,
        streams: Streams | None,
        ranks: RankOptions,
        enable_inplace_copy_batch: bool = False,
        dmp_collection_sync_interval_batches: int | None = 1,
        context_type: type[BatchContext] = BatchContext,
        lookahead: int = 0,
    ) -> None:
        TrainPipeline.__init__(self)
        self._model = model
        self._optimizer = optimizer
        self._device = device
        self._model_fwd: Callable[[Any], Any] = custom_model_fwd or model
        self._execute_all_batches = execute_all_batches
        self._inplace_copy = enable_inplace_copy_batch
        self._streams: Streams = streams if streams is not None else streams_for(device)
        self._ranks = Ranks(ranks, model=model, next_batch=self._next_batch)  # a subclass's, if any
        """Backward runs a collective over every rank that has completed when it returns (known at
        the first backward)."""
        self._context_type = context_type
        self._lookahead = lookahead
        interval = dmp_collection_sync_interval_batches
        self._dmp_collection_sync_interval_batches = sync_interval(model, interval)
        """torchrec's name: None unless the model is a `DMPCollection` (read by `sync_embeddings`)."""
        self._on_host = device.type == "cpu"
        """Batches stay where the dataloader made them (on the host, `.to("cpu")` moves nothing)."""
        self._step_context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
        """What each step runs inside (compiled autograd: `pipeline.pipelines.pt2`)."""
        self._on_reset: list[Callable[[], None]] = []
        """What the components drop when the pipeline resets (besides the streams' work)."""
        self._on_step_end: list[Callable[[], None]] = []
        """What the components are told when a step has ended (the watches stop their step's clock)."""
        self._lanes: dict[int, Lane] = {}
        self._next_index = 0

    @abc.abstractmethod
    def _fill(self, lane: Lane) -> None:
        """Put in flight what the next step needs (nothing once the lane ran dry)."""

    @abc.abstractmethod
    def _step(self, lane: Lane) -> Any:
        """Run one step on the head batch of `lane`, pop it, return its output."""

    @property
    def optimizer(self) -> Any:
        """The optimizer stepped after each training batch's backward (settable: a
        `GradientAccumulationWrapper` puts its accumulating optimizer here)."""
        return self._optimizer

    @optimizer.setter
    def optimizer(self, optimizer: Any) -> None:
        self._optimizer = optimizer

    @property
    def untrained_batches(self) -> list[Any]:
        """Batches this rank fetched but did not train because another rank's data ended first
        (`on_uneven="stop"`), as copied to the device, in dataloader order."""
        return self._ranks.untrained_batches

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """Run one batch through forward (and, in training mode, backward and optimizer).

        Returns:
            The model's output for the oldest batch in flight from `dataloader_iter`.

        Raises:
            StopIteration: every batch of `dataloader_iter` has been processed.
        """
        lane = self._enter(dataloader_iter)
        self._streams.poll()  # what the last step's streams are done with goes before this one copies
        try:
            output = self._advance(lane)
        except StopIteration as stop:  # from inside the step: the lane's end is `_ENDED`, not this
            error = StopIterationInStepError()
            self._fail(error)
            raise error from stop
        except AgreedError:
            self.reset()  # every rank raises it at the same step: the process group is fine
            self._ranks.settle_votes()
            raise
        except BaseException as e:
            self._fail(e)
            raise
        if output is _ENDED:
            raise StopIteration  # the only StopIteration `progress()` lets out: this lane's end
        return output

    def _advance(self, lane: Lane) -> Any:
        """`progress()`'s work: fill the lane and step it; `_ENDED` once it is empty."""
        draining = lane.state is LaneState.DRAINING
        if not (self._execute_all_batches or draining) and not self._look_ahead(lane):
            for ctx in lane.inflight:  # the dataloader ended before this step's look-ahead: drop all
                self._streams.release(ctx)
            lane.inflight.clear()
        self._fill(lane)
        if not lane.inflight:
            del self._lanes[id(lane.iterator)]
            self._ranks.settle_votes()
            return _ENDED
        head = lane.inflight[0]
        if self._step_context is None:
            output = self._step(lane)
        else:
            with self._step_context():
                output = self._step(lane)
        # the step queued every stream's last use of what was handed off for the batch (the
        # caller's: backward, where autograd reads the saved inputs); the output leaves
        self._streams.release(head)
        self._streams.returned(output)
        for ended in self._on_step_end:
            ended()
        lane.steps += 1
        self._ranks.settle_votes()  # nothing in flight between calls: the caller may tear down
        return output

    def _fail(self, error: BaseException) -> None:
        """This rank raised `error` inside `progress()`: the failure path (`Ranks.fail`), which
        makes sure no peer is left waiting in a collective for this rank."""
        try:
            self._ranks.fail(error, self.reset)
        finally:
            self._ranks.settle_votes()

    def drain(self, dataloader_iter: Iterator[Any]) -> list[Any]:
        """Run every batch in flight from `dataloader_iter` without fetching another.

        Call it on every rank at the same step before saving a checkpoint: the model, the optimizer
        and the dataloader's state then agree (every batch fetched has been trained), so a run
        resumed from them trains each batch exactly once. The next `progress(dataloader_iter)`
        starts filling the pipeline again.

        Returns:
            The outputs of the batches it ran, oldest first.
        """
        lane = self._lanes.get(id(dataloader_iter))
        if lane is None or lane.iterator is not dataloader_iter:
            return []
        lane.drain()
        outputs = []
        while True:
            try:
                outputs.append(self.progress(dataloader_iter))
            except StopIteration:
                return outputs

    def dataloader_state(self, dataloader_iter: Iterator[Any]) -> Any:
        """The state of `dataloader_iter` (which must have `state_dict()`) as of the oldest batch
        fetched from it and not yet trained.

        Call it between two `progress()` calls and save it with the model and optimizer: a run
        restored from the three (the dataloader by `load_state_dict` of this state) trains every
        batch exactly once, bit-for-bit as an uninterrupted run, with no `drain()` and no pipeline
        fill (docs/pipeline.md, "Checkpointing").

        Raises:
            TypeError: `dataloader_iter` has no `state_dict()` (use `drain()` instead).
        """
        lane = self._lanes.get(id(dataloader_iter))
        inflight = lane.inflight if lane is not None and lane.iterator is dataloader_iter else ()
        return resume_state(dataloader_iter, inflight)

    def reset(self) -> None:
        """Drop every in-flight batch (after an exception, or to abandon an iterator)."""
        self._streams.discard()
        for reset in self._on_reset:
            reset()
        self._lanes.clear()

    def _enter(self, dataloader_iter: Iterator[Any]) -> Lane:
        """The lane of `dataloader_iter` (opened on first use), whose step runs now."""
        lane = self._lanes.get(id(dataloader_iter))
        if lane is None or lane.iterator is not dataloader_iter:
            lane = self._lanes[id(dataloader_iter)] = self._ranks.open_lane(dataloader_iter)
        self._ranks.lane = lane  # the lane whose batches this step's stages work on
        return lane

    def _look_ahead(self, lane: Lane) -> bool:
        """Copy batches until `_lookahead` batches follow the head; False if the dataloader ends
        first. Only copies: nothing is started on the batches that may be dropped."""
        while len(lane.inflight) <= self._lookahead:
            if not self._enqueue(lane):
                return False
        # Across ranks this waits for the vote on the newest batch at once (this option's cost).
        return all(self._ranks.admit(lane, c) for c in list(lane.inflight)[: self._lookahead + 1])
