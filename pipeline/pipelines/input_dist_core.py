"""`InputDistCore`: the base of `TrainPipelineSparseDist`, and so of every class that torchrec derives
from it (Fused, SemiSync, Prefetch, Eval, Lite, PEC, the stash pipelines, ...): the one builder of
their machinery (`_build`), their `InputDist` component and its public face, `rewrite_report`,
`input_dist_schedule`, `tuner`, `released_bytes`, `detach()`/`attach()`. Each class declares its
constructor, passes its arguments on to `_build`, adds what differs and writes its step in its own
module, calling its `InputDist` by name (`TrainPipelineSparseDist`'s step: sparse_dist.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from pipeline.compat.arguments import refuse_jit
from pipeline.compat.methods import SparseDistMethods
from pipeline.config import InputDistOptions, RankOptions, RewriteOptions, fields_in, resolve
from pipeline.pipelines.core import PipelineCore
from pipeline.stages.context import BatchContext
from pipeline.stages.input_dist import InputDist
from pipeline.stages.memory import MemoryFlags
from pipeline.stages.streams import Streams
from pipeline.stages.watch import ScheduleWatch
from rewrite import RewriteReport

__all__ = ["InputDistCore"]


class InputDistCore(SparseDistMethods, PipelineCore):
    """A `PipelineCore` with an `InputDist` (made by `_build` in the class's constructor), and
    torchrec's methods of its `TrainPipelineSparseDist` (`pipeline.compat.methods`)."""

    _input_dist: InputDist
    _status_rides_splits = True
    """Every batch is admitted through `InputDist.fill` and `start_next`, so its status can ride on its
    splits all-to-all (`InputDist`'s `carry`); False for a class that admits batches itself."""

    @property
    def input_dist_schedule(self) -> str:
        """The input_dist schedule in use, a name from `pipeline.stages.schedule.SCHEDULES` (under the
        default, "adaptive", it may change once or twice: `tuner`)."""
        return self._input_dist.schedule

    @property
    def tuner(self) -> ScheduleWatch | None:
        """Under the default ("adaptive"), the schedule watch: `print(pipe.tuner)` says what it
        observed, at which step, what it kept and why (`choice`, `reason`, `decisions`). None where
        the schedule is pinned."""
        return self._input_dist.watch

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

    def _build(self, arguments: dict[str, Any], /, **fixed: Any) -> None:
        """The one construction of every class of the family: each constructor passes its own
        arguments, `locals()`, and what its class fixes or derives (`fixed`, which wins over an
        argument of the same name), then adds what differs. Of `arguments` only the names that
        `_compose` takes are read: torchrec's `context_type`, the arguments with no effect here
        and the class's own (`site_fqn`, ...) are not."""
        given = {name: value for name, value in arguments.items() if name in _COMPOSED}
        self._compose(**{**given, **fixed})

    def _compose(
        self,
        model: nn.Module,
        optimizer: Any,
        device: torch.device,
        *,
        apply_jit: bool,
        pipeline_postproc: bool,
        strict: bool,
        rewrite: RewriteOptions | None,
        rewrite_method: str | None,
        arg_paths: dict[str, Any] | None,
        streams: Streams | None,
        ranks: RankOptions | None,
        on_uneven: str | None,
        check_keys: bool | None,
        check_kjts: bool | None,
        agreement: bool | None,
        abort_on_error: bool | None,
        failure_grace: float | None,
        peer_timeout: timedelta | None,
        execute_all_batches: bool = True,
        custom_model_fwd: Callable[[Any], Any] | None = None,
        enable_inplace_copy_batch: bool = False,
        input_dist: InputDistOptions | None = None,
        input_dist_schedule: str | None = None,
        narrow_ids: bool | None = None,
        free_features_storage_early: bool = False,
        clear_data_dist_inputs: bool = False,
        dmp_collection_sync_interval_batches: int | None = 1,
        enqueue_batch_after_forward: bool = False,
        forward: str = "input_dist",
        batch_context: type[BatchContext] = BatchContext,
        lookahead: int = 2,
    ) -> None:
        """What `_build` runs, with the constructors' arguments (see `TrainPipelineSparseDist` for
        what they mean).

        Besides them: `forward`, what the hijacked forwards run (see `InputDist`);
        `batch_context`, the per-batch context the class's stages need; `lookahead`,
        how many batches must follow the head under `execute_all_batches=False` (torchrec's rule
        for the class). Options objects and their keywords are resolved here (`resolve`).
        """
        refuse_jit(apply_jit)
        PipelineCore.__init__(
            self,
            model,
            optimizer,
            device,
            execute_all_batches=execute_all_batches,
            custom_model_fwd=custom_model_fwd,
            streams=streams,
            ranks=resolve(ranks, RankOptions, **fields_in(locals(), RankOptions)),
            enable_inplace_copy_batch=enable_inplace_copy_batch,
            dmp_collection_sync_interval_batches=dmp_collection_sync_interval_batches,
            context_type=batch_context,
            lookahead=lookahead,
        )
        self._enqueue_batch_after_forward = enqueue_batch_after_forward
        self._clear_data_dist_inputs = clear_data_dist_inputs  # torchrec's attribute
        self._input_dist = InputDist(
            model,
            self._streams,
            rewrite=resolve(rewrite, RewriteOptions, method=rewrite_method, arg_paths=arg_paths),
            strict=strict,
            pipeline_postproc=pipeline_postproc,
            schedule=resolve(
                input_dist, InputDistOptions, schedule=input_dist_schedule, narrow_ids=narrow_ids
            ),
            memory=MemoryFlags(free_features_storage_early, clear_data_dist_inputs),
            forward=forward,
            ranks=self._ranks,
            carry=self._status_rides_splits and execute_all_batches,  # a look-ahead admits itself
        )
        self._on_reset.append(self._input_dist.interrupt)
        self._on_step_end.append(self._input_dist.step_ended)


_COMPOSED = frozenset(inspect.signature(InputDistCore._compose).parameters) - {"self"}
"""The names `_build` reads of a constructor's arguments."""
