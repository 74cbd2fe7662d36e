"""TrainPipelineSemiSync: the embedding lookup of batch i+1 runs before backward of batch i.

The lookup stage is `pipeline.lookup`'s; this module places it between forward and backward of
the previous batch (from `start_batch` on) and keeps four batches in flight: batch k+1 is fetched
before the input_dist of batch k starts, so that a rank whose data ended has written its flag in
the store before the collective after which the other ranks read it (`pipeline.agreement`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pipeline.base import _Lane
from pipeline.context import BatchContext
from pipeline.lookup import _LookupPipeline
from pipeline.schedule import SCHEDULES

__all__ = ["TrainPipelineSemiSync"]

logger = logging.getLogger(__name__)


class TrainPipelineSemiSync(_LookupPipeline):
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

    Args:
        model, optimizer, device, execute_all_batches, apply_jit, pipeline_postproc,
            custom_model_fwd: as `TrainPipelineSparseDist` (torchrec's positional order). Under
            `execute_all_batches=False` nothing is dropped, as in torchrec's class.
        start_batch: index of the first batch whose successor is looked up early (900, torchrec's
            default: a synchronous warm-up).
        stash_gradients: step the dense optimizer with the previous batch's gradients (torchrec's
            "true" semi-sync; the step at `start_batch` is skipped).
        strict: fail on the first batch if a sharded module cannot be pipelined or shares
            parameters with the dense optimizer.
        dmp_collection_sync_interval_batches, enable_inplace_copy_batch,
            free_features_storage_early, clear_data_dist_inputs: torchrec's options for 2D
            sharding and memory; accepted and ignored.
        **options: the keyword options of `TrainPipelineSparseDist`.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        start_batch: int = 900,
        stash_gradients: bool = False,
        pipeline_postproc: bool = True,
        custom_model_fwd: Callable[[Any], Any] | None = None,
        strict: bool = False,
        dmp_collection_sync_interval_batches: int | None = 1,
        enable_inplace_copy_batch: bool = False,
        free_features_storage_early: bool = False,
        clear_data_dist_inputs: bool = False,
        **options: Any,
    ) -> None:
        super().__init__(
            model,
            optimizer,
            device,
            execute_all_batches,
            apply_jit,
            None,
            pipeline_postproc,
            custom_model_fwd,
            strict=strict,
            **options,
        )
        self._start_batch = start_batch
        self._stash = stash_gradients
        self._stashed: dict[str, torch.Tensor] = {}
        self._strict_sharing = strict
        self._checked_sharing = False

    def _lookahead(self, lane: _Lane) -> int:
        return 0  # torchrec's SemiSync runs every batch under execute_all_batches=False too

    def _fill(self, lane: _Lane) -> None:
        for k in range(2):  # batches i and i+1: input_dist started, splits waited
            if not self._start(lane, k):
                return
            self._wait_splits(lane.inflight[k])

    def _start(self, lane: _Lane, k: int) -> bool:
        """Start input_dist of the k-th batch in flight; False if there is none. Batch k+1 is
        fetched first, so its flag is in the store before the ranks' next collective."""
        while len(lane.inflight) < k + 2 and self._enqueue(lane):
            pass
        if len(lane.inflight) <= k:
            return False
        ctx = lane.inflight[k]
        if not ctx.started:
            if not self._admit(lane, ctx):
                return False
            self._start_input_dist(ctx)
        return True

    def _step(self, lane: _Lane) -> Any:
        ctx = lane.inflight[0]
        training = self._model.training
        if self._tuner is not None:
            if training:
                self._schedule = self._tuner.next_schedule()
            else:
                self._tuner.interrupt()
        semi = training and ctx.index >= self._start_batch
        self._check_sharing()
        self._lookup(ctx)  # the first batch (later ones were looked up in the step before)
        third = lane.inflight[2] if self._start(lane, 2) else None
        if third is not None and SCHEDULES[self._schedule].early_splits:
            self._wait_splits(third)
        losses, output = self._forward(ctx)
        nxt = lane.inflight[1] if len(lane.inflight) > 1 else None
        if nxt is not None and semi:
            self._lookup(nxt)  # before the embedding update of batch i: one step stale
        if third is not None:
            self._wait_splits(third)
        if losses is not None:
            self._backward_and_step(ctx, losses)
        if nxt is not None and not semi:
            self._lookup(nxt)
        lane.inflight.popleft()
        return output

    def _optimizer_step(self, ctx: BatchContext) -> None:
        if self._stash and ctx.index >= self._start_batch:
            self._swap_gradients()
            if ctx.index == self._start_batch:
                return  # no stashed gradients yet
        self._optimizer.step()

    def _swap_gradients(self) -> None:
        """Stash this batch's dense gradients and put the previous batch's in their place."""
        for name, param in self._model.named_parameters():
            # as torchrec: a parameter without a gradient this step keeps its stash for the next
            previous = self._stashed.get(name)
            if param.grad is not None:
                self._stashed[name] = param.grad.clone()
            param.grad = previous

    def _check_sharing(self) -> None:
        if self._checked_sharing or self._rewrite is None:
            return
        self._checked_sharing = True
        if self._shares_optimizer():
            message = (
                "TrainPipelineSemiSync: a pipelined sharded module has parameters in the dense "
                "optimizer (e.g. feature processors); they change after the next batch's lookup "
                "used them, which autograd rejects or which trains on stale values"
            )
            if self._strict_sharing:
                raise ValueError(message)
            logger.warning(message)
