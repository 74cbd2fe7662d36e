"""`InputDistPipeline`: the public face and the step pieces shared by the pipelines that run
input_dist ahead of forward (SparseDist, Prefetch, Fused, SemiSync, Eval): `rewrite_report`,
`input_dist_schedule`, `tuner`, `detach()`/`attach()`, and the pieces of a step that start, finish
and retire the next batch's input_dist. Each class writes its step in its own module from these.
"""

from __future__ import annotations

from torch import nn

from pipeline.context import BatchContext
from pipeline.input_dist import InputDist
from pipeline.lanes import LanePipeline
from pipeline.options import PipelineOptions
from pipeline.ranks import Lane
from pipeline.tuner import Tuner
from rewrite import RewriteReport

__all__ = ["InputDistPipeline"]


class InputDistPipeline(LanePipeline):
    """A `LanePipeline` with an `InputDist` (made by `_make_input_dist` in the class's `_compose`)."""

    _input_dist: InputDist

    @property
    def input_dist_schedule(self) -> str:
        """The input_dist schedule in use, a name from `pipeline.schedule.SCHEDULES` (under "auto",
        changes while tuning and may change at a re-check)."""
        return self._input_dist.schedule

    @property
    def tuner(self) -> Tuner | None:
        """Under "auto", the tuner: `choice`, `reason`, `medians_ms` and `decisions` once it has
        decided."""
        return self._input_dist.tuner

    @property
    def rewrite_report(self) -> RewriteReport | None:
        """What the rewrite did to each sharded module; None before the first `progress()`."""
        return self._input_dist.report

    @property
    def released_bytes(self) -> int:
        """Bytes that `free_features_storage_early` and `clear_data_dist_inputs` released so far."""
        return self._input_dist.freed_bytes

    def detach(self) -> nn.Module:
        """Restore every original forward; the next `progress()` re-attaches.

        Batches in flight are kept and resume with the next `progress()` on their iterator.

        Returns:
            The model, as it was before the pipeline touched it.
        """
        self._streams.drain()
        self._input_dist.detach()
        return self._model

    def attach(self, model: nn.Module | None = None, sparse_dist: bool = True) -> None:
        """torchrec's counterpart of `detach()`: optional here, since `progress()` re-attaches.
        `model` replaces the pipeline's model (the same model, say, after loading a checkpoint)."""
        if model is not None and model is not self._model:
            self._input_dist.detach()
            self._model = model
            self._input_dist = self._make_input_dist(self._options, forward=self._input_dist_forward)

    def _make_input_dist(self, options: PipelineOptions, *, forward: str) -> InputDist:
        self._input_dist_forward = forward
        input_dist = InputDist(
            self._model,
            self._streams,
            rewrite=options.rewrite,
            schedule=options.input_dist,
            memory=options.memory,
            forward=forward,
        )
        self._on_reset.append(input_dist.reset)
        return input_dist

    # -- pieces of a step ---------------------------------------------------------------------

    def _start_head(self, lane: Lane) -> None:
        """Fill: the head batch admitted, its input_dist started and its splits waited; the batch
        after it copied."""
        if not lane.inflight:
            self._enqueue(lane)
        head = lane.inflight[0] if lane.inflight else None
        if head is not None and not head.started and self._ranks.admit(lane, head):
            self._input_dist.start(head)
            self._input_dist.wait_splits(head)
        if len(lane.inflight) < 2:
            self._enqueue(lane)

    def _start_next(self, lane: Lane) -> BatchContext | None:
        """Admit batch i+1 (its input_dist is its first collective) and start its input_dist,
        waiting for its splits now under an early schedule. None if there is no such batch."""
        nxt = lane.inflight[1] if len(lane.inflight) > 1 else None
        if nxt is None or not self._ranks.admit(lane, nxt):
            return None
        self._input_dist.start(nxt)
        if self._input_dist.early_splits:
            self._input_dist.wait_splits(nxt)
        return nxt

    def _finish_next(self, lane: Lane, nxt: BatchContext | None, *, fetched_before: bool = True) -> None:
        """After forward of batch i: wait for batch i+1's splits (a no-op after early ones). Every
        rank fetched batch i+2 before issuing those splits (`fetched_before`), so once they are
        waited and span every rank, its flags may be read."""
        if nxt is None:
            return
        self._input_dist.wait_splits(nxt)
        if nxt.splits_span_world and fetched_before:
            self._ranks.after_world_collective(lane, 2)

    def _retire_head(self, lane: Lane, nxt: BatchContext | None, *, read_next: bool = False) -> None:
        """The head batch is done: pop it. Where no splits all-to-all over every rank let the flags
        of batch i+2 be read (or `read_next`), this step's collectives (backward's) have: read now."""
        lane.inflight.popleft()
        if read_next or nxt is None or not nxt.splits_span_world:
            self._ranks.after_world_collective(lane, 1)
