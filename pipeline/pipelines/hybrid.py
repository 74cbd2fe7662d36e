"""TrainEvalHybridPipelineBase: one pipeline for training and evaluation batches, each trained or
evaluated by the model's mode at the `progress()` call that returns it. Batches are kept per
dataloader iterator (a `Lane`), so `progress(eval_it)` returns only batches of `eval_it` while the
training batches in flight wait, their input_dist started. torchrec's class keeps one queue for
both: the first outputs of an eval pass are training batches run in eval mode (never trained), and
the first after it an eval batch run in training mode.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from pipeline.compat.types import PipelineState
from pipeline.config import InputDistOptions, RankOptions, RewriteOptions
from pipeline.pipelines.sparse_dist import TrainPipelineSparseDist
from pipeline.ranks import Lane, LaneState
from pipeline.stages.context import BatchContext, TrainPipelineContext
from pipeline.stages.streams import Streams

__all__ = ["TrainEvalHybridPipelineBase"]


class TrainEvalHybridPipelineBase(TrainPipelineSparseDist):
    """SparseDist that trains a batch in training mode and only evaluates it in eval mode.

    Per `progress(it)` call: the SparseDist step on the oldest batch of `it` (copy of i+2,
    input_dist of i+1, forward of i); then, if `model.training`, backward and optimizer step; else
    forward ran under `no_grad` and nothing is stepped. Use it as torchrec's: `model.train()` and
    `progress(train_it)` for training steps, `model.eval()` and `progress(eval_it)` until
    StopIteration for an evaluation pass (every eval batch is evaluated, then StopIteration; the
    next `progress(eval_it)` with a new iterator starts a new pass), then `model.train()` again.
    Numerics: the training batches give the plain loop's outputs and parameters, bit for bit, as
    if no evaluation had run; each eval output is `model(batch)` under `no_grad` with the
    parameters of that moment. `_state` follows torchrec's `PipelineState`.

    Args (torchrec's, in its order, then ours, keyword-only): as in `TrainPipelineSparseDist`;
    under `execute_all_batches=False` a training iterator's last two batches are dropped (as by
    SparseDist), an eval pass runs every batch (as torchrec's); the default schedule watches
    training steps only.
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
        enqueue_batch_after_forward: bool = False,
        enable_inplace_copy_batch: bool = False,
        free_features_storage_early: bool = False,
        clear_data_dist_inputs: bool = False,
        async_inplace_copy: bool = False,
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
        self._build(locals(), execute_all_batches=True)  # the training steps' tail rule is `_fill`'s
        self._train_all_batches = execute_all_batches
        self._last_mode: str | None = None

    @property
    def last_output_mode(self) -> str | None:
        """How the batch of the output `progress()` returned last ran: "train" (forward,
        backward, optimizer step) or "eval" (forward only, under `no_grad`); None before."""
        return self._last_mode

    def _fill(self, lane: Lane) -> None:
        draining = lane.state is LaneState.DRAINING
        if self._model.training and not (self._train_all_batches or draining) and not self._look_ahead(lane):
            lane.inflight.clear()  # a training iterator ended before this step's look-ahead: drop all
        self._input_dist.fill(lane, self._enqueue)

    def _step(self, lane: Lane) -> Any:
        ctx, input_dist = lane.inflight[0], self._input_dist
        training = self._model.training
        self._state = PipelineState.IDLE
        input_dist.choose_schedule(training)
        input_dist.release_inputs(ctx)
        copy_late = self._enqueue_batch_after_forward
        if not copy_late and len(lane.inflight) < 3:
            self._enqueue(lane)
        nxt = input_dist.start_next(lane)
        self._wait_for_batch()
        self._state = PipelineState.CALL_FWD
        losses, output = self._forward(ctx, train=training, input_dist=input_dist)
        if copy_late and len(lane.inflight) < 3:
            self._enqueue(lane)
        if nxt is not None:
            input_dist.wait_splits(nxt)  # a no-op after early splits
        if training:
            self._state = PipelineState.CALL_BWD
            self._backward_stage(ctx, losses)
            self._sync_replicas(ctx)
            self._optimizer_stage(ctx)
        lane.inflight.popleft()
        self._last_mode = "train" if training else "eval"
        return output
