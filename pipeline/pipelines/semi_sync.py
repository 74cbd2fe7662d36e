"""TrainPipelineSemiSync: the embedding lookup of batch i+1 runs before backward of batch i.

The lookup stage is `pipeline.stages.lookup`'s; this module places it between forward and backward of
the previous batch (from `start_batch` on) and keeps four batches in flight: batch k+1 is fetched
(and its vote started) before the input_dist of batch k starts, so that the vote has a step to
arrive before batch k+1 is admitted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from pipeline.compat.methods import SemiSyncMethods
from pipeline.config import InputDistOptions, RankOptions, RewriteOptions
from pipeline.pipelines.sparse_dist import TrainPipelineSparseDist
from pipeline.ranks import Lane
from pipeline.stages.context import BatchContext, LookupBatchContext
from pipeline.stages.lookup import LookupStage
from pipeline.stages.streams import Streams

__all__ = ["TrainPipelineSemiSync"]

logger = logging.getLogger(__name__)


class TrainPipelineSemiSync(SemiSyncMethods, TrainPipelineSparseDist):
    """The embedding lookup of batch i+1 runs before backward of batch i, so it reads embeddings
    one update stale (torchrec 1.8's semi-synchronous training).

    Per `progress()` call that returns batch i, from batch `start_batch` on: copy of i+3, input_dist
    of i+2, forward of i, lookup of i+1 (its pooled-embedding all-to-all then overlaps backward and
    optimizer of i), backward of i, optimizer step. Before `start_batch` (the warm-up) the lookup
    of i+1 runs after the optimizer step of i instead: the plain loop's numerics.

    Numerics, for the batch with index j (0-based; indexes count every batch this pipeline
    fetched, as torchrec's contexts do): forward sees the dense parameters as updated by step j-1
    (which, with `stash_gradients`, applied the gradients of batch j-2) and, for j > `start_batch`,
    the embeddings as updated by batch j-2, not j-1: the embedding gradient of batch j-1 is applied
    after batch j looked its rows up. Gradients are those of that forward. Bit for bit equal to the
    plain loop with this staleness (tests/test_family.py has it in 20 lines), not to the plain loop.
    `drain()` ends the chain: the first batch after it is looked up in up-to-date tables.
    Pipelined modules whose parameters the dense optimizer also steps (feature processors'
    position weights) are updated in place after the next batch's lookup used them, which autograd
    rejects: a warning (an error under `strict`) says so.

    Args (torchrec's, in its order; the rest, and our keyword-only ones, as in `TrainPipelineSparseDist`;
    under `execute_all_batches=False` nothing is dropped, as in torchrec's class):
        start_batch: index of the first batch whose successor is looked up before its backward.
        stash_gradients: step the dense optimizer with the previous batch's gradients (torchrec's
            "true" semi-sync).
    """

    _status_rides_splits = False  # it admits batches itself

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        start_batch: int = 900,
        stash_gradients: bool = False,
        pipeline_postproc: bool = True,
        custom_model_fwd: Callable[[Any], tuple[torch.Tensor, Any]] | None = None,
        strict: bool = False,
        dmp_collection_sync_interval_batches: int | None = 1,
        enable_inplace_copy_batch: bool = False,
        free_features_storage_early: bool = False,
        clear_data_dist_inputs: bool = False,
        *,
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
        if not isinstance(start_batch, int) or start_batch < 0:
            raise ValueError(f"start_batch must be an int >= 0; got {start_batch!r}")
        self._build(locals(), forward="lookup", batch_context=LookupBatchContext, lookahead=0)
        self._lookup = LookupStage(self._streams, self._input_dist, model, optimizer)
        self._start_batch = start_batch
        self._stash = stash_gradients
        self._stashed: dict[str, torch.Tensor] = {}
        self._strict_sharing = strict
        self._checked_sharing = False

    def _fill(self, lane: Lane) -> None:
        for k in range(2):  # batches i and i+1: input_dist started, splits waited
            if not self._start(lane, k):
                return
            self._input_dist.wait_splits(lane.inflight[k])

    def _start(self, lane: Lane, k: int) -> bool:
        """Start input_dist of the k-th batch in flight (batch k+1 fetched first); False if there
        is none."""
        while len(lane.inflight) < k + 2 and self._enqueue(lane):
            pass
        if len(lane.inflight) <= k:
            return False
        ctx = lane.inflight[k]
        if not ctx.started:
            if not self._ranks.admit(lane, ctx):
                return False
            self._input_dist.start(ctx)
        return True

    def _step(self, lane: Lane) -> Any:
        ctx = lane.inflight[0]
        input_dist, lookup = self._input_dist, self._lookup
        training = self._model.training
        input_dist.choose_schedule(training)
        semi = training and ctx.index >= self._start_batch
        self._check_sharing()
        lookup.run(ctx)  # the first batch (later ones were looked up in the step before)
        third = lane.inflight[2] if self._start(lane, 2) else None
        if third is not None and input_dist.early_splits:
            input_dist.wait_splits(third)
        self._wait_for_batch()
        losses, output = self._forward(ctx, train=True, input_dist=input_dist)
        nxt = lane.inflight[1] if len(lane.inflight) > 1 else None
        if nxt is not None and semi:
            lookup.run(nxt)  # before the embedding update of batch i: one step stale
        if third is not None:
            input_dist.wait_splits(third)
        if losses is not None:
            lookup.backward_and_step(
                losses, lambda losses: self._backward_and_sync(ctx, losses), lambda: self._stashed_step(ctx)
            )
        if nxt is not None and not semi:
            lookup.run(nxt)
        lane.inflight.popleft()
        return output

    def _backward_and_sync(self, ctx: BatchContext, losses: Any) -> None:
        self._backward_stage(ctx, losses)
        self._sync_replicas(ctx)

    def _stashed_step(self, ctx: BatchContext) -> None:
        """The optimizer step; with `stash_gradients`, on the previous batch's dense gradients."""
        if self._stash and ctx.index >= self._start_batch:
            self._swap_gradients()
            if ctx.index == self._start_batch:
                return  # no stashed gradients yet
        self._optimizer_stage(ctx)

    def _swap_gradients(self) -> None:
        """Stash this batch's dense gradients and put the previous batch's in their place."""
        for name, param in self._model.named_parameters():
            # as torchrec: a parameter without a gradient this step keeps its stash for the next
            previous = self._stashed.get(name)
            if param.grad is not None:
                self._stashed[name] = param.grad.clone()
            param.grad = previous

    def _check_sharing(self) -> None:
        if self._checked_sharing or self._input_dist.rewrite is None:
            return
        self._checked_sharing = True
        if self._lookup.shares_optimizer():
            message = (
                "TrainPipelineSemiSync: a pipelined sharded module has parameters in the dense "
                "optimizer (e.g. feature processors); they change after the next batch's lookup "
                "used them, which autograd rejects or which trains on stale values"
            )
            if self._strict_sharing:
                raise ValueError(message)
            logger.warning(message)
