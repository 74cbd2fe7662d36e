"""TrainPipelineSparseDistBwdOpt: SparseDist whose optimizer step runs inside backward, from an
injection site at a sharded module's output all-to-all (`pipeline.stages.backward_step`), so that on
a GPU the step overlaps the rest of backward. torchrec's class (experimental) steps at the site
whatever the gradients are there, so where one is not final yet (DDP all-reduces at the end of
backward; a branch such as DLRM's dense arch is differentiated after the site) its numbers differ
from the plain loop's; ours steps at the site or as soon as after it every gradient is final.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torchrec.distributed.types import ShardingType

from pipeline.compat.backward_injection import (
    InjectionSite,
    InjectionTargetType,
    OutputDistTensorFinder,
    hook_backward,
)
from pipeline.config import InputDistOptions, RankOptions, RewriteOptions
from pipeline.pipelines.sparse_dist import TrainPipelineSparseDist
from pipeline.ranks import Lane
from pipeline.stages.backward_step import StepInBackward, StepPlacement
from pipeline.stages.context import BatchContext, TrainPipelineContext
from pipeline.stages.streams import Streams
from rewrite import unwrap_model

__all__ = ["TrainPipelineSparseDistBwdOpt"]


class TrainPipelineSparseDistBwdOpt(TrainPipelineSparseDist):
    """SparseDist with the optimizer stage moved into backward, at the output all-to-all of
    `site_fqn` (the all-to-all of its `sharding_type` tables), once every gradient it applies is
    final there or later.

    Numerics: the plain loop's, bit for bit (torchrec's class differs from it: see the module).
    `step_placement` is where the last step ran: at the site; at the last dense gradient after it
    (no DDP); at the end of backward, after DDP's all-reduce (the dense part of a
    DistributedModelParallel is DDP-wrapped by default, so this is the usual case on several
    ranks, and then nothing overlaps); or after backward (the site was not reached: on one rank
    the output all-to-all is no collective and has no backward of its own). The rewrite report
    notes each placement other than the site the first time it happens.

    Args (torchrec's, in its order; the rest, and our keyword-only ones, as in `TrainPipelineSparseDist`):
        site_fqn: the sharded module whose output all-to-all's backward is the injection site,
            as the user's model names it (inside DistributedModelParallel).
        sharding_type: which of its output all-to-alls (one per sharding type).
        dmp_collection_sync_interval_batches: the replicas sync after backward, after the step,
            as torchrec's.

    Raises:
        ValueError: `site_fqn` is not a module of the model.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        site_fqn: str,
        sharding_type: ShardingType = ShardingType.TABLE_WISE,
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
        self._in_backward = StepInBackward(model, optimizer, self._step_head)
        self._on_reset.append(self._in_backward.disarm)
        site = InjectionSite(site_fqn, OutputDistTensorFinder(sharding_type), InjectionTargetType.ACTIVATION)
        in_backward = self._in_backward
        hook_backward(
            site, unwrap_model(model), lambda grad: in_backward.at_site(), active=lambda: in_backward.armed
        )
        self._noted: set[StepPlacement] = set()

    @property
    def step_placement(self) -> StepPlacement | None:
        """Where the optimizer stage of the last training step ran (None before the first)."""
        return self._in_backward.placement

    def _step(self, lane: Lane) -> Any:
        ctx = lane.inflight[0]
        input_dist, in_backward = self._input_dist, self._in_backward
        input_dist.choose_schedule(self._model.training)
        input_dist.release_inputs(ctx)
        copy_late = self._enqueue_batch_after_forward
        if not copy_late and len(lane.inflight) < 3:
            self._enqueue(lane)
        nxt = input_dist.start_next(lane)
        self._wait_for_batch()
        if self._model.training:
            in_backward.arm()  # the injection site's hook and the gradients' hooks act from here
        losses, output = self._forward(ctx, train=True, input_dist=input_dist)
        if copy_late and len(lane.inflight) < 3:
            self._enqueue(lane)
        if nxt is not None:
            input_dist.wait_splits(nxt)  # a no-op after early splits
        if losses is not None:
            self._backward_stage(ctx, losses)  # the optimizer stage runs inside, from its hooks
            self._sync_replicas(ctx)
            self._note(in_backward.finish())  # or here, when backward did not run it
        else:
            in_backward.disarm()
        lane.inflight.popleft()
        return output

    def _step_head(self) -> None:
        """The optimizer stage of the batch in backward (the head of the lane)."""
        self._optimizer_stage(self._ranks.lane.inflight[0])

    def _note(self, placement: StepPlacement) -> None:
        report = self._input_dist.report
        if placement in self._noted or placement is StepPlacement.AT_SITE or report is None:
            return
        self._noted.add(placement)
        report.notes.append(f"TrainPipelineSparseDistBwdOpt: the optimizer step ran {placement.value}")
