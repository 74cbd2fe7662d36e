"""`InputDistCore`: what the pipelines that run input_dist ahead of forward (SparseDist, Prefetch,
Fused, SemiSync, Eval) share besides `PipelineCore`: their `InputDist` component and its public
face, `rewrite_report`, `input_dist_schedule`, `tuner`, `released_bytes`, `detach()`/`attach()`.
Each class writes its step in its own module, calling its `InputDist` by name.
"""

from __future__ import annotations

import dataclasses
import functools

from torch import nn

from pipeline.config import InputDistOptions, RewriteOptions
from pipeline.pipelines.core import PipelineCore
from pipeline.predictor.prior import schedule_prior
from pipeline.stages.input_dist import InputDist
from pipeline.stages.memory import MemoryFlags
from pipeline.stages.tuner import Tuner
from rewrite import RewriteReport

__all__ = ["InputDistCore"]


class InputDistCore(PipelineCore):
    """A `PipelineCore` with an `InputDist` (made by `_make_input_dist` in the class's constructor)."""

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

    def _make_input_dist(
        self,
        *,
        forward: str,
        rewrite: RewriteOptions,
        strict: bool,
        pipeline_postproc: bool,
        schedule: InputDistOptions,
        memory: MemoryFlags,
        predict_as: str = "sparse-dist",
    ) -> InputDist:
        """The class's `InputDist`, reset with the pipeline (`forward`: see `InputDist`). Under "auto"
        without a tuner of the caller's, the tuner starts from the cost model's prediction for the
        class `predict_as` names (`pipeline.predictor.prior`)."""
        if schedule.schedule == "auto" and schedule.tuner is None:
            predictor = functools.partial(schedule_prior, pipeline=predict_as)
            schedule = dataclasses.replace(schedule, tuner=Tuner(predictor=predictor))
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
