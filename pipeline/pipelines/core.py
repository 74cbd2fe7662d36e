"""`PipelineCore`: what every pipeline class shares, and only that. It keeps the batches in flight
per dataloader iterator (`Lane`), runs `progress()` / `drain()` / `reset()` / `close()`, and has the
stages every class runs on a batch: the copy (fetched through the ranks' protocol, then host to
device on the memcpy stream), forward, backward, the replicas' sync and the optimizer step, each
labelled (`run_stage`). The stages call torchrec's protected methods that a user's subclass
overrides: `_next_batch` for every batch fetched, `_backward`, `_optimizer_step`, and
`_wait_for_batch` (with torchrec's two signatures, one per class family).

Lanes: batches are kept per dataloader iterator, so that `progress()` with another iterator (an
eval loader) parks the batches in flight of the first one, and calling it again with the first
resumes them: no batch is lost, repeated or run in the other loader's loop. Across ranks, every
batch is admitted by the ranks' protocol (`pipeline.ranks.Ranks`) before its first collective.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import os
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pipeline.compat import TrainPipeline, sync_interval
from pipeline.options import RankOptions, moved_keyword
from pipeline.ranks import AgreedError, Lane, LaneState, Ranks, StopIterationInStepError
from pipeline.ranks.protocol import capture, resume_state
from pipeline.stages.context import BatchContext
from pipeline.stages.streams import Streams, label, run_stage, streams_for

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11

__all__ = ["PipelineCore", "to_device", "to_device_in_place"]

_ENDED = object()
"""What `PipelineCore._advance` returns once the lane is empty (`progress()` then raises
StopIteration: the one StopIteration it lets out)."""
_NOTHING = contextlib.nullcontext()


class PipelineCore(TrainPipeline):
    """The machinery every pipeline class shares (a torchrec `TrainPipeline`). A class built on it
    declares its constructor (torchrec's parameters, then our options, keyword-only), calls this
    one, composes its components, and implements `_fill` (what must be in flight before a step)
    and `_step` (one step).

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

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        # Runs before Python binds the arguments to `__init__`: a keyword that an earlier release
        # took and an options object holds now is named with where it went (else Python's error).
        # It returns an instance of `cls`, so a type checker still checks the call against
        # `__init__`, whose signature an editor shows.
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
        # A pipeline dropped without close(): its groups and threads go with it (the finalizer
        # holds only them). Not at interpreter exit, where torch tears its groups down itself, nor
        # in a forked child (a DataLoader worker collecting the parent's garbage), which has
        # neither the groups' connections nor the threads.
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

    # -- progress, and what ends it ---------------------------------------------------------------

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """Run one batch through forward (and, in training mode, backward and optimizer).

        Returns:
            The model's output for the oldest batch in flight from `dataloader_iter`.

        Raises:
            StopIteration: every batch of `dataloader_iter` has been processed.
        """
        if self._closed:
            raise RuntimeError("this pipeline was closed: build a new one to train again")
        lane = self._enter(dataloader_iter)
        if not self._streams.inert:  # what the last step's streams are done with goes before this copies
            self._streams.poll()
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
        except Exception as e:
            self._fail(e)
            raise
        except BaseException as interrupt:  # KeyboardInterrupt, SystemExit (a preemption), GeneratorExit
            self._interrupted(interrupt)
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
        if not self._streams.inert:
            # the step queued every stream's last use of what was handed off for the batch (the
            # caller's: backward, where autograd reads the saved inputs); the output leaves
            self._streams.release(head)
            self._streams.returned(output)
        for ended in self._on_step_end:
            ended()
        lane.steps += 1
        self._ranks.settle_votes()  # nothing in flight between calls: the caller may tear down
        return output

    def _interrupted(self, interrupt: BaseException) -> None:
        """`progress()` was interrupted (Ctrl-C, a preemption's SIGTERM handler raising SystemExit):
        not a failure. The job's own handler runs next (a checkpoint, collectives on its groups), so
        the batches in flight are dropped and nothing is announced or destroyed; no vote is waited
        for (a peer may be stopping at another step)."""
        self.reset()
        self._ranks.drop_votes()

    def _fail(self, error: Exception) -> None:
        """This rank raised `error` inside `progress()`: the failure path (`Ranks.fail`), which
        makes sure no peer is left waiting in a collective for this rank."""
        try:
            self._ranks.fail(error, self.reset)
        finally:
            self._ranks.drop_votes()  # a vote in flight may never complete: nothing waits for it

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

    def close(self) -> None:
        """Release everything the pipeline made: drop the batches in flight, restore the model,
        destroy the process groups it created (the votes' group, the input all-to-alls' own groups)
        and end its threads. Call it on every rank at the same step, when done with the pipeline; a
        pipeline dropped without it releases the same at garbage collection. The job's own process
        groups are left as they are. `progress()` raises afterwards.
        """
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
        """The lane of `dataloader_iter` (opened on first use), whose step runs now."""
        lane = self._lanes.get(id(dataloader_iter))
        if lane is None or lane.iterator is not dataloader_iter:
            lane = self._lanes[id(dataloader_iter)] = Lane(dataloader_iter)
        self._lane = lane
        return lane

    def _look_ahead(self, lane: Lane) -> bool:
        """Copy batches until `_lookahead` batches follow the head; False if the dataloader ends
        first. Only copies: nothing is started on the batches that may be dropped."""
        while len(lane.inflight) <= self._lookahead:
            if not self._enqueue(lane):
                return False
        # Across ranks this waits for the vote on the newest batch at once (this option's cost).
        return all(self._ranks.admit(lane, c) for c in list(lane.inflight)[: self._lookahead + 1])

    # -- torchrec's subclass points ---------------------------------------------------------------

    def _next_batch(self, dataloader_iter: Iterator[Any]) -> Any | None:
        """The next batch of `dataloader_iter`, or None once it has ended.

        Every batch the pipeline fetches comes from here. An override may skip batches (call
        `super()._next_batch` again) or transform them; it must return None at the end, and only
        there (None ends this rank's data; the ranks then agree on where the data ended).
        """
        return next(dataloader_iter, None)

    def _backward(self, losses: torch.Tensor) -> None:
        """Backward of the loss of the batch at the head (`losses`: what the model returned).

        An override may scale or add to the loss; it must run backward once, since the optimizer
        steps on the gradients it leaves.
        """
        # a scalar loss needs no sum (one kernel launch less), and the gradient is the same
        loss = losses if isinstance(losses, torch.Tensor) and losses.dim() == 0 else torch.sum(losses)
        loss.backward()

    def _optimizer_step(self) -> None:
        """Step the optimizer after backward. An override may clip gradients first, skip a step
        or step a learning-rate scheduler too."""
        self._optimizer.step()

    # -- the stages of a batch ----------------------------------------------------------------------

    def _enqueue(self, lane: Lane) -> bool:
        """Fetch the next batch and copy it to the device, into the lane: the copy stage. False
        when nothing was added."""
        ctx = self._fetch_and_copy(lane, in_place=self._inplace_copy)
        if ctx is None:
            return False
        lane.inflight.append(ctx)
        return True

    def _fetch_and_copy(
        self, lane: Lane, *, in_place: bool, worker: Executor | None = None
    ) -> BatchContext | None:
        """The next batch of `lane` (`Ranks.fetch`, which records this rank's `Status` for it),
        copied to the device in a new context (its batch is None for a placeholder); None when
        nothing is to be added. With `worker`, a device copy is dispatched there: the context
        holds the host batch and the job until `BatchContext.wait_copy`."""
        loader_state = capture(lane.iterator)  # a no-drain checkpoint resumes from here
        fetched = self._ranks.fetch(lane)
        if fetched is None:
            return None
        batch, ticket = fetched
        ctx = self._context_type(index=self._next_index, streams=self._streams, ticket=ticket)
        ctx.loader_state = loader_state
        self._next_index += 1
        if batch is not None and (worker is None or self._on_host):
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
            if not streams.inert:
                streams.produced(copied)
        return copied

    def _forward(self, ctx: BatchContext, *, train: bool, input_dist: Any = None) -> tuple[Any, Any]:
        """The forward stage of `ctx`'s batch (waited for by `_wait_for_batch`); in training, after
        `zero_grad`. With `input_dist`, its slot holds `ctx` for the hijacked forwards (whose calls
        are checked after forward), and a forward the rewrite waits for runs unpipelined,
        recorded. Returns `(losses or None, output)`."""
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
                recording or _NOTHING,
            ):
                result = self._model_fwd(ctx.batch)
        finally:
            if slot is not None:
                slot.current = None
        if slot is not None and recording is None:
            slot.check_calls()  # a module called fewer times than it has call sites: no output
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

    def _wait_copied(self, batch: Any) -> None:
        """Make the copy stage's `batch` usable on the caller's stream (what `_wait_for_batch`
        does by default)."""
        streams = self._streams
        if not streams.inert:  # held for the caller's stream for the head batch, released after its step
            streams.handoff(batch, streams.memcpy, self._lane.inflight[0])
            streams.consumed(batch)

    def _backward_stage(self, ctx: BatchContext, losses: Any) -> None:
        """The backward stage of `ctx`'s batch: `_backward(losses)`, labelled."""
        with run_stage(self._streams, "backward", ctx.index):
            if ctx.wait_clock is None:
                self._backward(losses)
            else:  # the default schedule watches how long backward waits off the CPU
                with ctx.wait_clock:
                    self._backward(losses)

    def _sync_replicas(self, ctx: BatchContext) -> None:
        """After backward: a `DMPCollection` (2D sharding) syncs its replicas' embeddings and
        optimizer states every `dmp_collection_sync_interval_batches` batches, as torchrec's."""
        interval = self._dmp_collection_sync_interval_batches
        if interval is not None and ctx.index % interval == 0:
            with label("pipeline::dmp_collection_sync"):
                self._model.sync()

    def _optimizer_stage(self, ctx: BatchContext) -> None:
        """The optimizer stage of `ctx`'s batch: `_optimizer_step()`, labelled."""
        with run_stage(self._streams, "optimizer", ctx.index):
            self._optimizer_step()


def _release(groups: Any, streams: Streams, pid: int) -> None:
    """A pipeline's process groups destroyed and its streams' threads ended (its finalizer), in
    the process that made them."""
    if os.getpid() != pid:
        return
    groups.destroy_all()
    streams.close()


# -- the copy: a batch of any shape to the device ---------------------------------------------------
# A batch that implements torchrec's Pipelineable (`.to(device, non_blocking)`) moves itself; dicts,
# lists, tuples, namedtuples and dataclasses are moved field by field, so a batch need not be a
# torchrec type.


def to_device(batch: Any, device: torch.device, non_blocking: bool) -> Any:
    """`batch` with every tensor (and every object with `.to`) on `device`."""
    if isinstance(batch, torch.Tensor) or (
        hasattr(batch, "to")
        and not isinstance(batch, (dict, list, tuple, type))
        and not dataclasses.is_dataclass(batch)
    ):
        return batch.to(device=device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return type(batch)((k, to_device(v, device, non_blocking)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple takes its fields apart
        return type(batch)(*(to_device(v, device, non_blocking) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device, non_blocking) for v in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        if hasattr(batch, "to"):  # a Pipelineable dataclass, e.g. torchrec's Batch
            return batch.to(device=device, non_blocking=non_blocking)
        changes = {
            f.name: to_device(getattr(batch, f.name), device, non_blocking)
            for f in dataclasses.fields(batch)
            if f.init
        }
        return dataclasses.replace(batch, **changes)
    return batch


def to_device_in_place(batch: Any, device: torch.device, streams: Any) -> Any:
    """`batch` on `device`, its tensors allocated on the current stream and filled on the memcpy
    stream (torchrec's `enable_inplace_copy_batch`), so their memory belongs to the stream that
    uses them. Objects with their own `.to` (a KeyedJaggedTensor) are copied on memcpy as usual.
    Without a memcpy stream (CPU) this is `to_device`."""
    memcpy = streams.memcpy
    if memcpy is None:
        return to_device(batch, device, non_blocking=True)
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    out = _allocate(batch, device, streams, copies)
    current, fill = streams.current(), object()
    with streams.use(memcpy):
        # The new blocks may be memory the current stream still reads: the fill waits for it. And
        # the copies write memory the current stream owns: it is held until they are done, in
        # case the batch is dropped before the current stream waits for them.
        streams.handoff(out, current, fill)
        for dst, src in copies:
            dst.copy_(src, non_blocking=True)
    streams.release(fill)  # the copies are memcpy's last use
    return out


def _allocate(batch: Any, device: torch.device, streams: Any, copies: list) -> Any:
    """`batch` with each tensor replaced by an empty one on `device` (on the current stream), the
    pairs to copy appended to `copies`; objects with their own `.to` are moved on memcpy."""
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
