"""PrefetchTrainPipelineSparseDist: SparseDist plus a prefetch stage, so forward never waits on
communication and each module's `prefetch()` (an embedding cache filled ahead, e.g. `tiered/`) runs
for batch i+1 while batch i computes: on CUDA on the prefetch stream, on CPU on a worker thread
(stages and streams: `pipeline.stages`; the prefetch stage: `pipeline.stages.prefetch`).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from pipeline.config import InputDistOptions, PrefetchOptions, RankOptions, RewriteOptions, resolve
from pipeline.pipelines.sparse_dist import TrainPipelineSparseDist
from pipeline.ranks import Lane
from pipeline.stages.context import PrefetchBatchContext
from pipeline.stages.prefetch import PrefetchStage, prefetch_does_work
from pipeline.stages.prefetch_watch import PrefetchWatch
from pipeline.stages.streams import Streams
from pipeline.stages.thread_streams import streams_for
from rewrite import outermost_sharded, unwrap_model

__all__ = ["PrefetchTrainPipelineSparseDist"]


class PrefetchTrainPipelineSparseDist(TrainPipelineSparseDist):
    """Adds a prefetch stage: the input_dist wait and each module's `prefetch()` run before
    forward, on the prefetch stream, so forward never waits on communication.

    Args (torchrec's, in its order, then ours, keyword-only): as in `TrainPipelineSparseDist`
    (under `execute_all_batches=False` the last two batches are dropped, as by torchrec's fixed
    class; torchrec 1.8.0 drops four), and `prefetch_ahead`, `prefetch_watch`: the fields of
    `PrefetchOptions` (`prefetch` may give them).
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
        prefetch_ahead: bool | str | None = None,
        prefetch_watch: PrefetchWatch | None = None,
        strict: bool = False,
        rewrite: RewriteOptions | None = None,
        rewrite_method: str | None = None,
        arg_paths: dict[str, Any] | None = None,
        input_dist: InputDistOptions | None = None,
        input_dist_schedule: str | None = None,
        narrow_ids: bool | None = None,
        streams: Streams | None = None,
        ranks: RankOptions | None = None,
        on_uneven: str | None = None,
        check_keys: bool | None = None,
        check_kjts: bool | None = None,
        agreement: bool | None = None,
        abort_on_error: bool | None = None,
        failure_grace: float | None = None,
        peer_timeout: timedelta | None = None,
    ) -> None:
        if streams is None and device.type != "cuda":  # CPU: the prefetch stream is a worker thread
            streams = streams_for(device, prefetch_thread=True)
        self._build(locals(), forward="prefetch", batch_context=PrefetchBatchContext)
        options = resolve(prefetch, PrefetchOptions, prefetch_ahead=prefetch_ahead, watch=prefetch_watch)
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
            self._choose_mode()
        self._input_dist.fill(lane, self._enqueue)
        report = self._input_dist.report
        if first and not self._with_stage and report is not None:
            report.notes.append(
                "no sharded module's prefetch() moves data (kernels without a cache to fill): the "
                "Prefetch pipeline runs TrainPipelineSparseDist's step, with no prefetch stage"
            )

    def _choose_mode(self) -> None:
        modules = outermost_sharded(unwrap_model(self._model)).values()
        self._with_stage = any(prefetch_does_work(m) for m in modules)
        if not self._with_stage:
            self._input_dist.use_forward("input_dist")
            self._prefetch.stay_inline()

    def _step(self, lane: Lane) -> Any:
        if not self._with_stage:
            return super()._step(lane)  # TrainPipelineSparseDist's (no enqueue_batch_after_forward here)
        ctx = lane.inflight[0]
        input_dist, prefetch = self._input_dist, self._prefetch
        input_dist.choose_schedule(self._model.training)
        prefetch.start_step(self._model.training)  # under a trial: ahead or inline this step
        if len(lane.inflight) < 3:
            self._enqueue(lane)
        nxt = input_dist.start_next(lane)
        if nxt is not None and input_dist.early_splits:
            # on a worker thread the prefetch of batch i+1 starts as soon as its values all-to-all
            # is under way, and reads during forward too; the rows batch i uses are pinned
            prefetch.submit_early(nxt)
        prefetch.wait(ctx)  # submits it first if it did not run ahead
        self._wait_for_batch()
        losses, output = self._forward(ctx, train=True, input_dist=input_dist)
        if nxt is not None and not input_dist.wait_splits(nxt):  # a no-op after early splits
            nxt = None  # the ranks dropped it (its status rode on its splits)
        if nxt is not None and prefetch.ahead:
            # overlaps backward and optimizer of batch i (torchrec's GPU order); the rows it
            # needs are pinned by the kernel, so backward of i cannot lose them
            prefetch.submit(nxt)
        if losses is not None:
            self._backward_stage(ctx, losses)
            self._optimizer_stage(ctx)
        lane.inflight.popleft()
        return output
