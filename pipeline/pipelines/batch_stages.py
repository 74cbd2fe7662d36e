"""`BatchStages`: the stages every pipeline class runs on a batch, whichever its step: the copy
(fetch through the ranks' protocol, then the host-to-device copy on the memcpy stream), forward,
backward, the replicas' sync and the optimizer step, each labelled (`pipeline.stages.streams.run_stage`).
The classes' steps call them by name; `PipelineCore` (core.py) owns the state they read.

`SubclassPoints`: torchrec's protected methods that a user's subclass overrides and the stages call,
with torchrec's names and signatures (`_next_batch` for every batch fetched, `_backward`,
`_optimizer_step`; `_wait_for_batch`, with torchrec's two signatures, each class family defines).
docs/reference.md, "Subclassing", says what an override must do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from typing import Any

import torch
from torch import nn

from pipeline.ranks import Lane, Ranks
from pipeline.ranks.protocol import capture
from pipeline.stages.context import BatchContext
from pipeline.stages.copy import to_device, to_device_in_place
from pipeline.stages.input_dist import InputDist
from pipeline.stages.streams import Streams, label, run_stage

__all__ = ["BatchStages", "SubclassPoints"]

_NOTHING = contextlib.nullcontext()


class SubclassPoints:
    """The default `_next_batch`, `_backward` and `_optimizer_step` (torchrec's behaviour)."""

    _optimizer: Any

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


class BatchStages(SubclassPoints):
    """The copy, forward, backward, sync and optimizer stages of one batch (its context), on the
    state a `PipelineCore` sets up; they call torchrec's subclass points (`SubclassPoints`)."""

    _model: nn.Module
    _device: torch.device
    _model_fwd: Callable[[Any], Any]
    _inplace_copy: bool
    _streams: Streams
    _ranks: Ranks
    _context_type: type[BatchContext]
    _next_index: int
    _on_host: bool
    _dmp_collection_sync_interval_batches: int | None

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
            streams.produced(copied)
        return copied

    def _forward(
        self, ctx: BatchContext, *, train: bool, input_dist: InputDist | None = None
    ) -> tuple[Any, Any]:
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
        does by default: Base's, Lite's; `TrainPipelineSparseDist._wait_for_batch` spells it out)."""
        streams = self._streams
        # held for the caller's stream on behalf of the head batch, released after its step
        streams.handoff(batch, streams.memcpy, self._ranks.lane.inflight[0])
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
