"""PrefetchTrainPipelineSparseDist: SparseDist plus a prefetch stage, so forward never waits on
communication and each module's `prefetch()` (an embedding cache filled ahead, e.g. `tiered/`) runs
for batch i+1 while batch i computes: on CUDA on the prefetch stream, on CPU on a worker thread
(`pipeline.streams.ThreadStreams`). The stage table is in `pipeline.sparse_dist`'s docstring.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function

from pipeline.base import _Lane
from pipeline.context import BatchContext, PrefetchBatchContext
from pipeline.labels import stage
from pipeline.sparse_dist import TrainPipelineSparseDist
from pipeline.streams import ThreadStreams

__all__ = ["PrefetchTrainPipelineSparseDist"]


class PrefetchTrainPipelineSparseDist(TrainPipelineSparseDist):
    """Adds a prefetch stage: the input_dist wait and each module's `prefetch()` run before
    forward, on the prefetch stream, so forward never waits on communication.

    Same arguments as `TrainPipelineSparseDist` (torchrec's positional order, in which
    `pipeline_postproc` comes before `custom_model_fwd` and there is no `context_type`), plus:

    Args:
        prefetch_ahead: True: the prefetch stage of batch i+1 is submitted right after forward of
            i, so it overlaps backward and optimizer of i (on CPU on a worker thread, where under
            the early-splits schedules it is submitted before forward of i, so it overlaps forward
            too: the worker waits for the values all-to-all, then prefetches). False: it
            runs just before forward of i+1 (SparseDist's order; inline on CPU). "auto" (default):
            on CUDA True; on CPU True while the modules' `prefetch()` calls take at least
            `AHEAD_MIN_MS` a batch (median of batches 2 to 9), else False, since handing a
            near-empty stage to a thread costs more than it hides. `pipe.prefetch_ahead` says
            which is in use.
    """

    AHEAD_MIN_MS = 1.0
    """Under `prefetch_ahead="auto"` on CPU, the prefetch work per batch below which the stage
    stays on the main thread."""
    _AHEAD_SAMPLES = 8

    _context_type = PrefetchBatchContext
    _prefetch = True
    _prefetch_thread = True

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        pipeline_postproc: bool = True,
        custom_model_fwd: Callable[[Any], Any] | None = None,
        *,
        prefetch_ahead: bool | str = "auto",
        **options: Any,
    ) -> None:
        if prefetch_ahead not in (True, False, "auto"):
            raise ValueError(f'prefetch_ahead must be True, False or "auto"; got {prefetch_ahead!r}')
        super().__init__(
            model,
            optimizer,
            device,
            execute_all_batches,
            apply_jit,
            None,
            pipeline_postproc,
            custom_model_fwd,
            **options,
        )
        threads = isinstance(self._streams, ThreadStreams)
        self._ahead = prefetch_ahead if prefetch_ahead != "auto" else True
        self._ahead_auto = prefetch_ahead == "auto" and threads
        self._work_ms: list[float] = []  # prefetch() time per batch, for the "auto" choice
        if threads:
            self._streams.threaded = self._ahead

    @property
    def prefetch_ahead(self) -> bool:
        """Whether the prefetch stage of batch i+1 runs ahead, during backward of i (see
        `prefetch_ahead=`)."""
        return self._ahead

    def detach(self) -> nn.Module:
        self._streams.drain()
        return super().detach()

    def _after_splits(self, nxt: BatchContext) -> None:
        # On a worker thread, the prefetch of batch i+1 can start as soon as its values all-to-all
        # is under way: it waits for it there, then reads the disk during forward, backward and
        # optimizer of batch i. The rows batch i uses are pinned, so it never evicts them.
        if self._ahead and isinstance(self._streams, ThreadStreams) and self._streams.on_worker:
            self._submit_prefetch(nxt)

    def _after_forward(self, nxt: BatchContext) -> None:
        # The prefetch of batch i+1 overlaps backward and optimizer of batch i (torchrec's GPU
        # order; a no-op if it was submitted before forward); rows it needs are pinned by the
        # kernel, so backward of i cannot lose them.
        if self._ahead:
            self._submit_prefetch(nxt)

    def _lookahead(self, lane: _Lane) -> int:
        # torchrec's fetches batch 2 during its first step; with execute_all_batches=False its
        # fill_pipeline refills on the second step, from then on it holds 4 batches ahead of the
        # one it runs (train_pipelines.py, PrefetchTrainPipelineSparseDist.fill_pipeline).
        return 2 if lane.steps == 0 else 4

    def _before_forward(self, ctx: BatchContext) -> None:
        assert isinstance(ctx, PrefetchBatchContext)
        if ctx.prefetch_job is None:  # not ahead, the first batch, or another lane's successor
            self._submit_prefetch(ctx)
        ctx.prefetch_job.result()  # re-raises what went wrong on the prefetch stream
        if self._ahead_auto and len(self._work_ms) > self._AHEAD_SAMPLES:
            self._ahead_auto = False
            self._ahead = statistics.median(self._work_ms[1:]) >= self.AHEAD_MIN_MS
            self._streams.threaded = self._ahead

    def _submit_prefetch(self, ctx: BatchContext) -> None:
        assert isinstance(ctx, PrefetchBatchContext)
        if ctx.prefetch_job is None:
            forward_stream = self._streams.current()  # the caller's stream, where forward will run
            ctx.prefetch_job = self._streams.submit(
                self._streams.prefetch, lambda: self._prefetch(ctx, forward_stream)
            )

    def _prefetch(self, ctx: PrefetchBatchContext, forward_stream: Any) -> None:
        """The prefetch stage: wait for `ctx`'s input_dist, then each module's `prefetch()`."""
        streams = self._streams
        work = 0.0
        with stage(streams, "prefetch", ctx.index), torch.no_grad():
            for pm in self._rewrite.modules if self._rewrite else []:
                prepared = ctx.take_input_dist(pm.fqn)
                if prepared is None:
                    continue
                module_ctx, data = prepared
                start = time.perf_counter()
                with record_function(f"pipeline::prefetch::{pm.fqn}#{ctx.index}"):
                    pm.module.prefetch(dist_input=data, forward_stream=forward_stream, ctx=module_ctx)
                work += time.perf_counter() - start
                streams.produced(data)
                streams.produced(module_ctx)
                ctx.prefetched[pm.fqn] = (module_ctx, data)
        if self._ahead_auto:
            self._work_ms.append(work * 1e3)
