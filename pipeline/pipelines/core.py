"""`PipelineCore`, what every pipeline shares: a `Lane` of batches in flight per dataloader iterator (an
eval iterator parks the training ones, losing none), `progress()`, `drain()`, `close()` and the stages."""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pipeline.compat import TrainPipeline, sync_interval
from pipeline.options import RankOptions, moved_keyword
from pipeline.ranks import AgreedError, Lane, LaneState, Ranks, StopIterationInStepError
from pipeline.ranks.protocol import resume_state
from pipeline.stages.context import BatchContext
from pipeline.stages.streams import NO_LABEL, Streams, label, profiling, run_stage, streams_for

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11

__all__ = ["PipelineCore", "to_device", "to_device_in_place"]

_ENDED = object()
"""What `PipelineCore._advance` returns once the lane is empty (`progress()` then raises
StopIteration: the one StopIteration it lets out)."""


class PipelineCore(TrainPipeline):
    """The base of every pipeline class (a torchrec `TrainPipeline`): a class calls this constructor,
    composes its components and implements `_fill` and `_step`.

    Args:
        model: the model the pipeline runs.
        optimizer: stepped after each training batch's backward.
        device: where batches are copied to.
        execute_all_batches: run the batches in flight at the dataloader's end, or drop `lookahead` ones.
        custom_model_fwd: called with the batch instead of `model`.
        streams: the streams to run on; None: real streams on CUDA, none on CPU.
        ranks: how the ranks agree.
        enable_inplace_copy_batch: allocate the device copy on the stream that uses it (GPU).
        dmp_collection_sync_interval_batches: the replicas' sync interval of a `DMPCollection`.
        context_type: the per-batch context the class's stages need.
        lookahead: under `execute_all_batches=False`, the batches that must follow the head to run it.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        # runs before Python binds the keywords: a flat keyword of before is refused naming its option
        if (error := moved_keyword(cls, kwargs)) is not None:
            raise error
        return super().__new__(cls)

    def __init__(
        self,
        model: nn.Module,
        optimizer: Any,
        device: torch.device,
        *,
        execute_all_batches: bool,
        custom_model_fwd: Callable[[Any], Any] | None,
        streams: Streams | None,
        ranks: RankOptions | None,
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
        self._ranks = Ranks(ranks or RankOptions(), model=model, next_batch=self._next_batch)
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
        self._on_close: list[Callable[[], None]] = []
        """What the components release at `close()` (before the groups and the streams' threads)."""
        self._lanes: dict[int, Lane] = {}
        self._lane: Lane | None = None
        """The lane of the iterator last given to `progress()` (or to torchrec's methods): the
        batches torchrec's `batches` and `contexts` show, and `_wait_for_batch` waits for."""
        self._next_index = 0
        self._closed = False
        # A pipeline dropped without close() releases its groups and threads, but not at interpreter
        # exit (torch tears its groups down) nor in a forked child (a DataLoader worker), which has neither.
        self._finalizer = weakref.finalize(self, _release, self._ranks.groups, self._streams, os.getpid())
        self._finalizer.atexit = False

    @abc.abstractmethod
    def _fill(self, lane: Lane) -> None:
        """Put in flight what the next step needs (nothing once the lane ran dry)."""

    @abc.abstractmethod
    def _step(self, lane: Lane) -> Any:
        """Run one step on the head batch of `lane`, pop it, return its output."""

    @property
    def optimizer(self) -> Any:
        """The optimizer stepped after each backward (settable: `GradientAccumulationWrapper` sets it)."""
        return self._optimizer

    @optimizer.setter
    def optimizer(self, optimizer: Any) -> None:
        self._optimizer = optimizer

    @property
    def untrained_batches(self) -> list[Any]:
        """Batches fetched but not trained, another rank's data having ended first (`on_uneven="stop"`)."""
        return self._ranks.untrained_batches

    # -- progress, and what ends it ---------------------------------------------------------------

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """Run one batch through forward (and, in training mode, backward and optimizer).

        Returns:
            The model's output for the oldest batch in flight from `dataloader_iter`.

        Raises:
            StopIteration: every batch of `dataloader_iter` has been processed.
            RuntimeError: the pipeline was closed.
        """
        if self._closed:
            raise RuntimeError("this pipeline was closed: build a new one to train again")
        lane = self._lanes.get(id(dataloader_iter))
        if lane is None or lane.iterator is not dataloader_iter:
            lane = self._enter(dataloader_iter)
        self._lane = lane
        if not self._streams.in_order:  # what the last step's streams are done with goes before this copies
            self._streams.poll()
        try:
            output = self._advance(lane)
        except StopIteration as stop:  # from inside the step: the lane's end is `_ENDED`, not this
            error = StopIterationInStepError()
            self._fail(error)
            raise error from stop
        except AgreedError:
            self.reset()  # every rank raises it at the same step: the process group is fine
            self._ranks.wait_votes()
            raise
        except Exception as e:
            self._fail(e)
            raise
        except BaseException as interrupt:  # KeyboardInterrupt, SystemExit (a preemption), GeneratorExit
            self._interrupted(interrupt)
            raise
        if output is _ENDED:
            raise StopIteration
        return output

    def _advance(self, lane: Lane) -> Any:
        draining = lane.state is LaneState.DRAINING
        if not (self._execute_all_batches or draining) and not self._look_ahead(lane):
            for ctx in lane.inflight:  # the dataloader ended before this step's look-ahead: drop all
                self._streams.release(ctx)
            lane.inflight.clear()
        self._fill(lane)
        if not lane.inflight:
            del self._lanes[id(lane.iterator)]
            self._ranks.wait_votes()
            return _ENDED
        head = lane.inflight[0]
        if self._step_context is None:
            output = self._step(lane)
        else:
            with self._step_context():
                output = self._step(lane)
        if not self._streams.in_order:
            # the step queued every stream's last use of the batch's hand-offs (backward's included)
            self._streams.release(head)
            self._streams.returned(output)
        for ended in self._on_step_end:
            ended()
        lane.steps += 1
        if self._ranks.pending_votes:  # nothing in flight between calls: the caller may tear down
            self._ranks.wait_votes()
        return output

    def _interrupted(self, interrupt: BaseException) -> None:
        """Not a failure (Ctrl-C, SystemExit from a preemption): the job's own handler runs next, so the
        batches in flight are dropped, nothing is destroyed, and no vote is waited for."""
        self.reset()
        self._ranks.drop_votes()

    def _fail(self, error: Exception) -> None:
        """This rank raised `error` in `progress()`: `Ranks.fail`, so no peer is left waiting for it."""
        try:
            self._ranks.fail(error, self.reset)
        finally:
            self._ranks.drop_votes()  # a vote in flight may never complete: nothing waits for it

    def drain(self, dataloader_iter: Iterator[Any]) -> list[Any]:
        """Run every batch in flight from `dataloader_iter` without fetching another.

        Call it on every rank at the same step before saving a checkpoint (docs/pipeline.md,
        "Checkpointing"); the next `progress(dataloader_iter)` fills the pipeline again.

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
        """The state of `dataloader_iter` as of the oldest batch fetched from it and not yet trained.

        Call it between two `progress()` calls and save it with the model and optimizer: a run restored
        from the three trains every batch exactly once (docs/pipeline.md, "Checkpointing").

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

    def close(self) -> None:
        """Release what the pipeline made: the batches in flight, the rewrite of the model, its process
        groups (not the job's) and threads; `progress()` raises afterwards. Call it on every rank at
        the same step (a pipeline dropped without it releases the same at garbage collection)."""
        if self._closed:
            return
        self._closed = True
        self.reset()
        self._ranks.drop_votes()
        for close in self._on_close:
            close()
        self._ranks.close()
        self._streams.close()
        self._finalizer.detach()

    def _enter(self, dataloader_iter: Iterator[Any]) -> Lane:
        lane = self._lanes.get(id(dataloader_iter))
        if lane is None or lane.iterator is not dataloader_iter:
            lane = self._lanes[id(dataloader_iter)] = Lane(dataloader_iter)
        self._lane = lane
        return lane

    def _look_ahead(self, lane: Lane) -> bool:
        """Copy (and start nothing on) batches until `_lookahead` follow the head; False: the data ended."""
        while len(lane.inflight) <= self._lookahead:
            if not self._enqueue(lane):
                return False
        # Across ranks this waits for the vote on the newest batch at once (this option's cost).
        return all(self._ranks.admit(lane, c) for c in list(lane.inflight)[: self._lookahead + 1])

    # -- torchrec's subclass points ---------------------------------------------------------------

    def _next_batch(self, dataloader_iter: Iterator[Any]) -> Any | None:
        """The next batch of `dataloader_iter`, or None once it has ended: every fetch comes here. An
        override may skip or transform batches; it must return None at the end, and only there."""
        return next(dataloader_iter, None)

    def _backward(self, losses: torch.Tensor) -> None:
        """Backward of the head batch's `losses` (what the model returned). An override may scale or
        add to the loss; it must run backward once, since the optimizer steps on its gradients."""
        # a scalar loss needs no sum (one kernel launch less), and the gradient is the same
        loss = losses if isinstance(losses, torch.Tensor) and losses.dim() == 0 else torch.sum(losses)
        loss.backward()

    def _optimizer_step(self) -> None:
        """Step the optimizer after backward; an override may clip gradients, skip or add a step."""
        self._optimizer.step()

    # -- the stages of a batch ----------------------------------------------------------------------

    def _enqueue(self, lane: Lane) -> bool:
        """The copy stage: the next batch fetched and copied into the lane (False: nothing added)."""
        ctx = self._fetch_and_copy(lane, in_place=self._inplace_copy)
        if ctx is None:
            return False
        lane.inflight.append(ctx)
        return True

    def _fetch_and_copy(
        self, lane: Lane, *, in_place: bool, worker: Executor | None = None
    ) -> BatchContext | None:
        """The next batch of `lane` (`Ranks.fetch`) copied in a new context (batch None: a placeholder);
        None when nothing is to be added. With `worker`, the copy runs there (`BatchContext.wait_copy`)."""
        loader_state = lane.iterator_state() if lane.iterator_state is not None else None
        fetched = self._ranks.fetch(lane)
        if fetched is None:
            return None
        batch, ticket = fetched
        ctx = self._context_type(index=self._next_index, streams=self._streams, ticket=ticket)
        ctx.loader_state = loader_state
        self._next_index += 1
        if batch is not None and self._on_host and self._streams.in_order and not profiling():
            ctx.batch = batch  # `_copy_stage` on the host, with nothing to order or label: the batch
        elif batch is not None and (worker is None or self._on_host):
            ctx.batch = self._copy_stage(ctx.index, batch, in_place)
        elif batch is not None:
            ctx.batch, ctx.copy_job = batch, worker.submit(self._copy_stage, ctx.index, batch, in_place)
        return ctx

    def _copy_stage(self, index: int, batch: Any, in_place: bool) -> Any:
        """The copy stage of batch `index`, on the memcpy stream (of the calling thread)."""
        streams = self._streams
        with run_stage(streams, "copy", index, streams.memcpy):
            if self._on_host:
                copied = batch  # a host batch is already where it goes: no walk, no new objects
            elif in_place:
                copied = to_device_in_place(batch, self._device, streams)
            else:
                copied = to_device(batch, self._device, non_blocking=True)
            if not streams.in_order:
                streams.produced(copied)
        return copied

    def _forward(self, ctx: BatchContext, *, train: bool, input_dist: Any = None) -> tuple[Any, Any]:
        """The forward stage of `ctx`'s batch (in training, after `zero_grad`), with `ctx` in
        `input_dist`'s slot for the hijacked forwards. Returns `(losses or None, output)`."""
        slot = input_dist.slot if input_dist is not None else None
        recording = input_dist.recording(ctx) if input_dist is not None else None
        streams = self._streams
        training = train and self._model.training
        if training:
            self._optimizer.zero_grad()
        if slot is not None:
            slot.current = ctx
        try:
            with (
                run_stage(streams, "forward", ctx.index),
                torch.set_grad_enabled(training),
                recording or NO_LABEL,
            ):
                result = self._model_fwd(ctx.batch)
        finally:
            if slot is not None:
                slot.current = None
        if slot is not None and recording is None:
            slot.check_calls()  # a module called fewer times than it has call sites: no output
        if not training:
            # as torchrec: `output` of a `(loss, output)` pair, else the value as it is
            is_pair = isinstance(result, tuple) and len(result) == 2
            return None, result[1] if is_pair else result
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(
                "in training mode the model (or custom_model_fwd) must return (loss, output); got "
                f"{type(result).__name__}. Wrap the model or pass custom_model_fwd."
            )
        return result

    def _wait_copied(self, batch: Any) -> None:
        """Make the copy stage's `batch` usable on the caller's stream."""
        streams = self._streams
        if not streams.in_order:  # held for the caller's stream for the head batch, released after its step
            streams.handoff(batch, streams.memcpy, self._lane.inflight[0])
            streams.consumed(batch)

    def _backward_stage(self, ctx: BatchContext, losses: Any) -> None:
        """The backward stage of `ctx`'s batch: `_backward(losses)`, labelled."""
        with run_stage(self._streams, "backward", ctx.index):
            clock = ctx.wait_clock
            if clock is None or clock.thread != threading.get_ident():
                self._backward(losses)
                return
            # the default schedule watches how long backward waits off the CPU (`WaitClock.idle`)
            wall, cpu = clock.now(), clock.cpu()
            try:
                self._backward(losses)
            finally:
                clock.idle += max(0.0, (clock.now() - wall) - (clock.cpu() - cpu))

    def _sync_replicas(self, ctx: BatchContext) -> None:
        """After backward, a `DMPCollection` syncs its replicas every sync interval, as torchrec's."""
        interval = self._dmp_collection_sync_interval_batches
        if interval is not None and ctx.index % interval == 0:
            with label("pipeline::dmp_collection_sync"):
                self._model.sync()

    def _optimizer_stage(self, ctx: BatchContext) -> None:
        """The optimizer stage of `ctx`'s batch: `_optimizer_step()`, labelled."""
        with run_stage(self._streams, "optimizer", ctx.index):
            self._optimizer_step()


def _release(groups: Any, streams: Streams, pid: int) -> None:
    if os.getpid() != pid:
        return
    groups.destroy_all()
    streams.close()


# -- the copy: a batch of any shape to the device ---------------------------------------------------


def to_device(batch: Any, device: torch.device, non_blocking: bool) -> Any:
    """`batch` on `device`: an object with `.to` (torchrec's Pipelineable) moves itself; dicts, lists,
    tuples, namedtuples and dataclasses are moved field by field."""
    if isinstance(batch, dict):
        return type(batch)((k, to_device(v, device, non_blocking)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple takes its fields apart
        return type(batch)(*(to_device(v, device, non_blocking) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device, non_blocking) for v in batch)
    if hasattr(batch, "to") and not isinstance(batch, type):  # a tensor, or a Pipelineable (dataclass or not)
        return batch.to(device=device, non_blocking=non_blocking)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        changes = {
            f.name: to_device(getattr(batch, f.name), device, non_blocking)
            for f in dataclasses.fields(batch)
            if f.init
        }
        return dataclasses.replace(batch, **changes)
    return batch


def to_device_in_place(batch: Any, device: torch.device, streams: Any) -> Any:
    """`batch` on `device`, allocated on the current stream (which uses it) and filled on memcpy."""
    memcpy = streams.memcpy
    if memcpy is None:
        return to_device(batch, device, non_blocking=True)
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    out = _allocate(batch, device, streams, copies)
    current, fill = streams.current(), object()
    with streams.use(memcpy):
        # The fill waits for the current stream, which may still read the new blocks' memory, and holds
        # them until the copies are done, in case the batch is dropped before the stream waits for them.
        streams.handoff(out, current, fill)
        for dst, src in copies:
            dst.copy_(src, non_blocking=True)
    streams.release(fill)  # the copies are memcpy's last use
    return out


def _allocate(batch: Any, device: torch.device, streams: Any, copies: list) -> Any:
    if isinstance(batch, torch.Tensor):
        out = torch.empty_like(batch, device=device)
        copies.append((out, batch))
        return out
    if isinstance(batch, dict):
        return type(batch)((k, _allocate(v, device, streams, copies)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_allocate(v, device, streams, copies) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_allocate(v, device, streams, copies) for v in batch)
    with streams.use(streams.memcpy):
        return to_device(batch, device, non_blocking=True)
