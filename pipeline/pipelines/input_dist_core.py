"""`InputDistCore`: what the pipelines that run input_dist ahead of forward (SparseDist, Prefetch,
Fused, SemiSync, Eval) share besides `PipelineCore`: their `InputDist` component and its public
face, `rewrite_report`, `input_dist_schedule`, `tuner`, `released_bytes`, `detach()`/`attach()`.
Each class writes its step in its own module, calling its `InputDist` by name.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pipeline.compat.methods import SparseDistMethods
from pipeline.config import InputDistOptions, RewriteOptions
from pipeline.pipelines.core import PipelineCore
from pipeline.ranks import Lane
from pipeline.stages.input_dist import InputDist
from pipeline.stages.memory import MemoryFlags
from pipeline.stages.tuner import Tuner
from rewrite import RewriteReport

__all__ = ["InputDistCore"]


class InputDistCore(SparseDistMethods, PipelineCore):
    """A `PipelineCore` with an `InputDist` (made by `_make_input_dist` in the class's constructor),
    and torchrec's methods of its `TrainPipelineSparseDist` (`pipeline.compat.methods`)."""

    _input_dist: InputDist

    @property
    def input_dist_schedule(self) -> str:
        """The input_dist schedule in use, a name from `pipeline.stages.schedule.SCHEDULES` (under "auto",
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

        Raises:
            BaseException: work on a side stream (a prefetch submitted ahead) failed and nothing
                raised its error yet; the model is restored all the same.
        """
        try:
            self._streams.wait_all()
        finally:
            self._input_dist.detach()
        return self._model

    def attach(self, model: nn.Module | None = None, sparse_dist: bool = True) -> None:
        """torchrec's counterpart of `detach()`; optional here, since `progress()` re-attaches.

        Raises:
            ValueError: `model` is not the pipeline's model (build a new pipeline for another).
        """
        if model is not None and model is not self._model:
            raise ValueError("attach(model) takes the pipeline's own model; build a new pipeline for another")

    def _wait_for_batch(self) -> None:
        """Make the head batch (`self.batches[0]`), copied to the device on the memcpy stream,
        usable on the caller's: torchrec's subclass point, with its signature on this family;
        each step calls it before forward."""
        self._wait_copied(self._ranks.lane.inflight[0].batch)

    def _sparse_dist_step(self, lane: Lane, *, copy_after_forward: bool) -> Any:
        """TrainPipelineSparseDist's step (also Prefetch's when no module has prefetch work): the
        copy of batch i+2 (after forward of i if `copy_after_forward`) and the input_dist of i+1
        overlap forward, backward and optimizer of i."""
        ctx = lane.inflight[0]
        input_dist = self._input_dist
        input_dist.choose_schedule(self._model.training)
        input_dist.release_inputs(ctx)
        if not copy_after_forward and len(lane.inflight) < 3:
            self._enqueue(lane)
        nxt = input_dist.start_next(lane)
        self._wait_for_batch()
        losses, output = self._forward(ctx, train=True, input_dist=input_dist)
        if copy_after_forward and len(lane.inflight) < 3:
            self._enqueue(lane)  # after forward: on a GPU the copy does not compete with lookups
        if nxt is not None:
            input_dist.wait_splits(nxt)  # a no-op after early splits
        if losses is not None:
            self._backward_stage(ctx, losses)
            self._sync_replicas(ctx)
            self._optimizer_stage(ctx)
        lane.inflight.popleft()
        return output

    def _make_input_dist(
        self,
        *,
        forward: str,
        rewrite: RewriteOptions,
        strict: bool,
        pipeline_postproc: bool,
        schedule: InputDistOptions,
        memory: MemoryFlags,
    ) -> InputDist:
        """The class's `InputDist`, reset with the pipeline (`forward`: see `InputDist`)."""
        self._clear_data_dist_inputs = memory.clear_data_dist_inputs  # torchrec's attribute
        input_dist = InputDist(
            self._model,
            self._streams,
            rewrite=rewrite,
            strict=strict,
            pipeline_postproc=pipeline_postproc,
            schedule=schedule,
            memory=memory,
            forward=forward,
            ranks=self._ranks,
        )
        self._on_reset.append(input_dist.interrupt)
        return input_dist
