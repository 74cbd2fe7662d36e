"""TrainPipelineSparseDistT: TrainPipelineSparseDist whose host-to-device copy is dispatched from a
worker thread, so the caller's thread does not spend its time issuing the copies of batch i+2. The
copy is submitted to one worker thread in step i, where it runs on the memcpy stream (a CUDA stream
is per thread: the worker enters it itself); the batch is taken from the worker
(`BatchContext.wait_copy`) in step i+1, before its input_dist starts. On the host nothing is copied:
on CPU the class is `TrainPipelineSparseDist`, step for step, with no thread hop.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch

from pipeline.config import InputDistOptions, RankOptions, RewriteOptions
from pipeline.pipelines.sparse_dist import TrainPipelineSparseDist
from pipeline.ranks import Lane
from pipeline.stages.context import BatchContext, TrainPipelineContext
from pipeline.stages.streams import Streams

__all__ = ["TrainPipelineSparseDistT"]


class TrainPipelineSparseDistT(TrainPipelineSparseDist):
    """SparseDist with the copy of batch i+2 dispatched from a worker thread (on a device).

    Numerics: the plain loop's, bit for bit (the copy's dispatch moves, not what it copies).

    Args (torchrec's, in its order, then ours, keyword-only): as in `TrainPipelineSparseDist`
    (`enable_inplace_copy_batch`: the worker allocates on its own current stream, as torchrec's).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        context_type: type[BatchContext] = TrainPipelineContext,
        pipeline_postproc: bool = False,
        custom_model_fwd: Callable[[Any], tuple[torch.Tensor, Any]] | None = None,
        dmp_collection_sync_interval_batches: int | None = 1,
        enable_inplace_copy_batch: bool = False,
        free_features_storage_early: bool = False,
        clear_data_dist_inputs: bool = False,
        *,
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
        self._build(locals())
        self._copy_worker: ThreadPoolExecutor | None = None
        """The copy's thread, started at the first copy off the host (never on CPU)."""

    def _enqueue_next(self, lane: Lane) -> bool:
        """`_enqueue`, with a copy off the host dispatched on the worker thread (SparseDist's step
        copies batch i+2 with it; `InputDist.start` waits for the copy)."""
        if self._copy_worker is None and not self._on_host:
            self._copy_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pipeline-copy")
        ctx = self._fetch_and_copy(lane, in_place=self._inplace_copy, worker=self._copy_worker)
        if ctx is None:
            return False
        lane.inflight.append(ctx)
        return True
