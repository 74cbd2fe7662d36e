"""PrefetchTrainPipelineSparseDist: SparseDist plus a prefetch stage, so forward never waits on
communication and each module's `prefetch()` (an embedding cache filled ahead, e.g. `tiered/`) runs
for batch i+1 while batch i computes: on CUDA on the prefetch stream, on CPU on a worker thread
(stages and streams: `pipeline.stages`; the prefetch stage: `pipeline.stages.prefetch`). Its step is
SparseDist's, with the prefetch stage placed by the step's hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pipeline.options import InputDistOptions, PrefetchOptions, RankOptions, RewriteOptions
from pipeline.pipelines.sparse_dist import TrainPipelineSparseDist
from pipeline.ranks import Lane
from pipeline.stages.context import BatchContext, PrefetchBatchContext
from pipeline.stages.prefetch import PrefetchStage, PrefetchWatch, prefetch_does_work
from pipeline.stages.streams import Streams, streams_for
from rewrite import outermost_sharded, unwrap_model

__all__ = ["PrefetchTrainPipelineSparseDist"]


class PrefetchTrainPipelineSparseDist(TrainPipelineSparseDist):
    """Adds a prefetch stage: the input_dist wait and each module's `prefetch()` run before
    forward, on the prefetch stream, so forward never waits on communication.

    Args (torchrec's, in its order, then ours, keyword-only): as in `TrainPipelineSparseDist`
    (under `execute_all_batches=False` the last two batches are dropped, as by torchrec's fixed
    class; torchrec 1.8.0 drops four), and `prefetch`: when the stage runs (`PrefetchOptions`).
    `streams` None: on CPU a prefetch worker thread.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        pipeline_postproc: bool = True,
        custom_model_fwd: Callable[[Any], tuple[torch.Tensor, Any]] | None = None,
        enable_inplace_copy_batch: bool = False,
        free_features_storage_early: bool = False,
        clear_data_dist_inputs: bool = False,
        async_inplace_copy: bool = False,
        *,
        prefetch: PrefetchOptions | None = None,
        strict: bool = False,
        rewrite: RewriteOptions | None = None,
        input_dist: InputDistOptions | None = None,
        ranks: RankOptions | None = None,
        streams: Streams | None = None,
    ) -> None:
        self._setup(
            model,
            optimizer,
            device,
            execute_all_batches=execute_all_batches,
            apply_jit=apply_jit,
            pipeline_postproc=pipeline_postproc,
            custom_model_fwd=custom_model_fwd,
            enable_inplace_copy_batch=enable_inplace_copy_batch,
            free_features_storage_early=free_features_storage_early,
            clear_data_dist_inputs=clear_data_dist_inputs,
            strict=strict,
            rewrite=rewrite,
            input_dist=input_dist,
            ranks=ranks,
            # CPU: the prefetch stream is a worker thread
            streams=streams if streams is not None else streams_for(device, prefetch_thread=True),
            forward="prefetch",
            context_type=PrefetchBatchContext,
        )
        options = prefetch or PrefetchOptions()
        self._prefetch = PrefetchStage(
            self._streams, self._input_dist, ahead=options.prefetch_ahead, watch=options.watch
        )
        self._with_stage: bool | None = None
        """Some sharded module's `prefetch()` moves data (decided at the first batch); without,
        the pipeline runs `TrainPipelineSparseDist`'s step: no prefetch stage, no thread hop."""

    @property
    def prefetch_ahead(self) -> bool:
        """Whether the prefetch stage of batch i+1 runs ahead, during backward of i."""
        return self._prefetch.ahead

    @property
    def prefetch_reason(self) -> str | None:
        """Under "auto" on CPU, once its watch has decided something: the last decision, in one line
        with what was measured (each is also a note of the rewrite report)."""
        watch = self._prefetch.watch
        return watch.reason if watch is not None else None

    @property
    def prefetch_watch(self) -> PrefetchWatch | None:
        """Under "auto" on CPU, the watch choosing ahead or inline: `print()` it to see what it saw
        and did; `state_dict()`/`load_state_dict()` carry its decision across a restart."""
        return self._prefetch.watch

    @property
    def prefetch_mode(self) -> str | None:
        """ "prefetch" (the prefetch stage runs), "sparse-dist" (no module has prefetch work: the
        step is `TrainPipelineSparseDist`'s), or None before the first batch."""
        if self._with_stage is None:
            return None
        return "prefetch" if self._with_stage else "sparse-dist"

    def _fill(self, lane: Lane) -> None:
        first = self._with_stage is None
        if first:
            modules = outermost_sharded(unwrap_model(self._model)).values()
            self._with_stage = any(prefetch_does_work(m) for m in modules)
            if not self._with_stage:
                self._input_dist.use_forward("input_dist")
                self._prefetch.stay_inline()
        self._input_dist.fill(lane, self._enqueue)
        report = self._input_dist.report
        if first and not self._with_stage and report is not None:
            report.notes.append(
                "no sharded module's prefetch() moves data (kernels without a cache to fill): the "
                "Prefetch pipeline runs TrainPipelineSparseDist's step, with no prefetch stage"
            )

    # The hooks: SparseDist's where no module has prefetch work (`_with_stage` False).

    def _step_begins(self, ctx: BatchContext) -> None:
        if not self._with_stage:
            return super()._step_begins(ctx)
        # under a trial: ahead or inline this step (the stage frees the sent inputs itself)
        self._prefetch.start_step(self._model.training)

    def _before_forward(self, ctx: BatchContext, nxt: BatchContext | None) -> None:
        if not self._with_stage:
            return
        prefetch = self._prefetch
        if nxt is not None and self._input_dist.early_splits:
            # on a worker thread the prefetch of batch i+1 starts as soon as its values all-to-all
            # is under way, and reads during forward too; the rows batch i uses are pinned
            prefetch.submit_early(nxt)
        prefetch.wait(ctx)  # submits it first if it did not run ahead

    def _after_forward(self, ctx: BatchContext, nxt: BatchContext | None, losses: Any) -> None:
        if self._with_stage and nxt is not None and self._prefetch.ahead:
            # overlaps backward and optimizer of batch i (torchrec's GPU order); the rows it
            # needs are pinned by the kernel, so backward of i cannot lose them
            self._prefetch.submit(nxt)

    def _backward_and_optimizer(self, ctx: BatchContext, losses: Any) -> None:
        if not self._with_stage:
            return super()._backward_and_optimizer(ctx, losses)
        self._backward_stage(ctx, losses)  # with the stage, torchrec's order: no replicas' sync
        self._optimizer_stage(ctx)
