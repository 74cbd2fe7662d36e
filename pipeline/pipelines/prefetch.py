"""PrefetchTrainPipelineSparseDist: SparseDist's step with a prefetch stage (`pipeline.stages.prefetch`)
placed by its hooks."""

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
    """SparseDist plus a prefetch stage: the input_dist wait and each module's `prefetch()` of batch i+1
    run before its forward, on the prefetch stream (on CPU a worker thread).

    Args (torchrec's, in its order, then ours, keyword-only): as in `TrainPipelineSparseDist`, and
        prefetch: when the prefetch stage runs (`PrefetchOptions`).
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
        """Under "auto" on CPU: its watch's last decision, in one line (also a note of the report)."""
        watch = self._prefetch.watch
        return watch.reason if watch is not None else None

    @property
    def prefetch_watch(self) -> PrefetchWatch | None:
        """Under "auto" on CPU, the watch choosing ahead or inline (`print()` it; `state_dict()`)."""
        return self._prefetch.watch

    @property
    def prefetch_mode(self) -> str | None:
        """ "prefetch", or "sparse-dist" where no module's `prefetch()` moves data; None before a batch."""
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

    def _step_begins(self, ctx: BatchContext) -> None:
        if not self._with_stage:
            return super()._step_begins(ctx)
        # the stage frees the sent inputs itself
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
