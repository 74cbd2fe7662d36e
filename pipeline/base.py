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

Ranks agree on every batch before it enters a collective (`pipeline.agreement`): a vote issued at
fetch and waited a step later says whether every rank has the batch and whether its keys are right.
So uneven data ends on every rank at the shortest rank's count, a batch with wrong keys stops every
rank with the same error, and a rank that raises makes its peers stop within seconds.
"""

from __future__ import annotations

import itertools
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from pipeline.agreement import (
    BAD_KEYS,
    EXHAUSTED,
    HAVE,
    AgreedError,
    Agreement,
    BatchKeysError,
    KeyCheck,
    StoreFlags,
    UnevenDataError,
    WorldCollectiveSeen,
    keys_message,
    uneven_message,
    warn_untrained,
)
from pipeline.batch import to_device
from pipeline.context import BatchContext
from pipeline.failure import FailureSignal, PeerFailedError, is_comm_error
from pipeline.labels import stage
from pipeline.loader_state import capture, resume_state
from pipeline.streams import Streams, streams_for

__all__ = ["TrainPipelineBase"]


@dataclass(eq=False)
class _Lane:
    iterator: Iterator[Any]
    inflight: deque[BatchContext] = field(default_factory=deque)
    exhausted: bool = False
    """This rank's iterator raised StopIteration (other ranks may still have batches)."""
    ended: bool = False
    """Every rank agreed that the data ended (nothing more is fetched)."""
    draining: bool = False
    """`drain()`: run what is in flight, fetch nothing."""
    fetched: int = 0
    """Batches taken from the iterator so far."""
    flags: Any = None
    """The lane's `StoreFlags` (across ranks, once a status other than HAVE may be published)."""
    enqueued: int = 0
    """Contexts added so far (placeholders included): the same count on every rank."""
    flagged_end: bool = False
    """This rank published that its iterator is exhausted."""
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
        on_uneven: when the ranks' dataloaders end at different batches: "stop" (default) trains
            the shortest rank's count on every rank, then StopIteration; the batches a longer rank
            fetched beyond it are in `untrained_batches`, with a warning. "error" raises
            `UnevenDataError` on every rank instead (docs/pipeline.md, "Uneven data").
        check_keys: compare each batch's KeyedJaggedTensor keys with the first batch's and raise
            `BatchKeysError` on every rank, before the batch enters a collective, if they differ.
        agreement: vote on every batch across ranks (what `on_uneven` and a key error on one rank
            need). False only when every rank is known to have the same batches: uneven data then
            leaves a collective unmatched, as in torchrec.
        abort_on_error: when this rank raises inside `progress()` (world size > 1), record the
            error in the process group's store and, unless every rank raised at the same step
            (within `failure_grace`), destroy this process's process groups, so the peers stop
            within seconds with `PeerFailedError` instead of waiting for the group's timeout
            (docs/pipeline.md, "When a rank fails"). The process groups cannot be used after that.
            False leaves them alone.
        failure_grace: seconds a failed rank waits for the others to fail too before destroying
            its process groups; the peers end about a second after that.
        peer_timeout: how long the per-batch vote waits for a peer that neither votes nor fails.
    """

    _context_type: type[BatchContext] = BatchContext
    _prefetch_thread = False  # on CPU, run the prefetch stage on a worker thread
    _trains = True  # False: forward only, in any mode (EvalPipelineSparseDist)

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        custom_model_fwd: Callable[[Any], Any] | None = None,
        *,
        execute_all_batches: bool = True,
        streams: Streams | None = None,
        on_uneven: str = "stop",
        check_keys: bool = True,
        agreement: bool = True,
        abort_on_error: bool = True,
        failure_grace: float = 2.0,
        peer_timeout: timedelta = timedelta(minutes=5),
    ) -> None:
        if on_uneven not in ("stop", "error"):
            raise ValueError(f'on_uneven must be "stop" or "error"; got {on_uneven!r}')
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
        self._on_uneven = on_uneven
        self._keys = KeyCheck() if check_keys else None
        self._agreement = Agreement(timeout=peer_timeout)
        self._voting = agreement and self._agreement.distributed
        """Ranks agree on every batch (else a rank's own status is all it knows)."""
        self._pipeline_id = next(_PIPELINE_IDS)
        self._lane_count = 0
        self._abort_on_error = abort_on_error
        self._failure = FailureSignal(grace=failure_grace)
        self._seen: WorldCollectiveSeen | None = None
        self.untrained_batches: list[Any] = []
        """Batches this rank fetched but did not train because another rank's data ended first
        (`on_uneven="stop"`), as copied to the device, in dataloader order."""

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """Run one batch through forward (and, in training mode, backward and optimizer).

        Returns:
            The model's output for the oldest batch in flight from `dataloader_iter`.

        Raises:
            StopIteration: every batch of `dataloader_iter` has been processed.
        """
        lane = self._lanes.get(id(dataloader_iter))
        if lane is None or lane.iterator is not dataloader_iter:
            lane = self._lanes[id(dataloader_iter)] = self._new_lane(dataloader_iter)
        try:
            if not (self._execute_all_batches or lane.draining) and not self._read_ahead(lane):
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
        except AgreedError:
            self.reset()  # every rank raises it at the same step: the process group is fine
            raise
        except BaseException as e:
            self._fail(e)
            raise

    def _new_lane(self, iterator: Iterator[Any]) -> _Lane:
        lane = _Lane(iterator)
        self._lane_count += 1  # the same on every rank: lanes are opened by lockstep progress()
        store = self._failure.store
        if self._voting and store is not None:
            lane.flags = StoreFlags(store, f"trainpipeline/p{self._pipeline_id}/lane{self._lane_count}")
        return lane

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
        lane.draining = True
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

    def _fail(self, error: BaseException) -> None:
        """This rank raised inside `progress()`: drop the batches in flight and, across ranks, make
        sure no peer is left waiting (`abort_on_error`). A failure that comes from a peer's (a
        collective broken by it) becomes `PeerFailedError`."""
        signal = self._failure
        if not (self._abort_on_error and signal.distributed):
            self.reset()
            return
        if is_comm_error(error):
            peers = signal.peer_failures()
            try:
                self.reset()
            finally:
                signal.abort()
            cause = "; ".join(peers) or "no rank recorded an error: a peer was probably killed or exited"
            raise PeerFailedError(
                f"rank {signal.rank} stopped because a peer failed ({cause}). This rank's process "
                "groups were destroyed; restart the job."
            ) from error
        signal.announce(error)
        every_rank_failed = signal.all_failed()
        signal.next_generation()
        try:
            self.reset()
        finally:
            if not every_rank_failed:  # a peer may be waiting in a collective for this rank
                signal.abort()

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
        # Across ranks this waits for the vote on the newest batch at once (this option's cost).
        return all(self._admit(lane, c) for c in list(lane.inflight)[: self._lookahead(lane) + 1])

    # -- stages shared by all pipelines -------------------------------------------------------

    def _enqueue(self, lane: _Lane) -> bool:
        """Fetch the next batch, vote on it and start copying it; False when nothing was added.

        Across ranks, a rank whose iterator is exhausted adds a placeholder (and votes EXHAUSTED)
        until the end is agreed, so every rank holds as many contexts and issues the same
        collectives."""
        if lane.ended or lane.draining:
            return False
        batch, status = None, EXHAUSTED
        loader_state = capture(lane.iterator)
        if not lane.exhausted:
            try:
                batch, status = next(lane.iterator), HAVE
            except StopIteration:
                lane.exhausted = True
        if status == EXHAUSTED and not self._voting:
            return False
        ctx = self._context_type(index=self._next_index, streams=self._streams)
        self._next_index += 1
        ctx.position = lane.fetched
        if status == HAVE:
            lane.fetched += 1
            if self._keys is not None and (found := self._keys.check(batch)) is not None:
                status, ctx.found_keys = BAD_KEYS, found
        ctx.status = status
        ctx.loader_state = loader_state
        if self._voting:
            # a vote where no collective of this rank's comes between this fetch and the other
            # ranks' reading of the flags: the lane's first two batches (the second is fetched
            # after the first's splits), and batches read ahead and admitted at once; else a flag
            if lane.flags is None or lane.enqueued < 2 or not self._execute_all_batches:
                ctx.vote = self._agreement.vote(status)
            elif status == BAD_KEYS or (status == EXHAUSTED and not lane.flagged_end):
                lane.flags.raise_flag(status, ctx.position)
                lane.flagged_end = status == EXHAUSTED
        if batch is not None:
            with stage(self._streams, "copy", ctx.index, self._streams.memcpy):
                ctx.batch = to_device(batch, self._device, non_blocking=True)
                self._streams.produced(ctx.batch)
        lane.inflight.append(ctx)
        lane.enqueued += 1
        return True

    def _admit(self, lane: _Lane, ctx: BatchContext) -> bool:
        """Wait for the ranks' votes on `ctx` (before its first collective). True: every rank has
        it. False: some rank's data ended there; `ctx` and everything after it are dropped on every
        rank. Raises the agreed errors (wrong keys; `on_uneven="error"`)."""
        if ctx.admitted:
            return True
        if ctx.vote is not None:
            statuses = ctx.vote.wait()
        elif self._voting and lane.flags is not None:
            statuses = lane.flags.statuses(ctx.position, self._failure.world, ctx.index)
            statuses[self._failure.rank] = ctx.status
        else:
            statuses = [ctx.status]
        if all(s == HAVE for s in statuses):
            ctx.admitted = True
            return True
        if BAD_KEYS in statuses:
            mine = (self._failure.rank, ctx.position, ctx.found_keys)
            details = self._agreement.gather(mine) if self._voting else [mine]
            raise BatchKeysError(keys_message(details, self._keys.expected if self._keys else None))
        dropped = list(lane.inflight)[lane.inflight.index(ctx) :]
        for _ in dropped:
            lane.inflight.pop()
        lane.ended = True
        if all(s == EXHAUSTED for s in statuses):
            return False  # every rank ended here: even data
        if self._on_uneven == "error":
            raise UnevenDataError(uneven_message(statuses, ctx.position))
        untrained = [c.batch for c in dropped if c.status != EXHAUSTED]
        if untrained:
            self.untrained_batches.extend(untrained)
            warn_untrained(self._failure.rank, len(untrained), statuses, ctx.position)
        return False

    def _read_flags_ahead(self, lane: _Lane, at: int) -> None:
        """Start reading the flags for `lane.inflight[at]` in the background (`StoreFlags.read_ahead`),
        so that the store's round trip overlaps the step instead of delaying its admission.

        Call only once this rank has completed a collective that every rank issued after fetching
        that batch."""
        if lane.flags is not None and len(lane.inflight) > at and lane.inflight[at].vote is None:
            lane.flags.read_ahead(lane.inflight[at].index)

    def _forward(self, ctx: BatchContext) -> tuple[Any, Any]:
        """Forward of `ctx`'s batch; returns `(losses or None, output)`."""
        streams = self._streams
        streams.handoff(ctx.batch, streams.memcpy)
        streams.consumed(ctx.batch)
        training = self._model.training and self._trains
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
        if lane.inflight:
            self._admit(lane, lane.inflight[0])  # forward is the first collective

    def _step(self, lane: _Lane) -> Any:
        ctx = lane.inflight[0]
        self._enqueue(lane)  # copy of i+1 overlaps compute of i
        losses, output = self._forward(ctx)
        # The next batch was fetched before this forward on every rank. Once every rank has done a
        # collective since, its flags are in the store: after a sharded module's input all-to-all
        # over every rank (the read then overlaps backward), else after backward's collectives (a
        # sharded model's all-to-alls, DDP's all-reduce; the read overlaps the optimizer step).
        read_early = lane.flags is not None and self._world_collective_seen().take()
        if read_early:
            self._read_flags_ahead(lane, 1)
        if losses is not None:
            with stage(self._streams, "backward", ctx.index):
                torch.sum(losses).backward()
        lane.inflight.popleft()
        if not read_early:
            self._read_flags_ahead(lane, 0)
        if losses is not None:
            with stage(self._streams, "optimizer", ctx.index):
                self._optimizer.step()
        return output

    def _world_collective_seen(self) -> WorldCollectiveSeen:
        if self._seen is None:  # hooks only for pipelines that run the sharded modules' own forward
            self._seen = WorldCollectiveSeen(self._model)
            # the model outlives the pipeline: a pipeline per epoch must not pile hooks up on it
            weakref.finalize(self, self._seen.remove)
        return self._seen


_PIPELINE_IDS = itertools.count()
"""Numbers pipelines in construction order, the same on every rank (names the store keys)."""
