"""TrainPipelineSparseDist: input_dist of the next batch runs ahead of forward.

Per `progress()` call that returns batch i:

| stage                                    | stream (CUDA) | batch |
|------------------------------------------|---------------|-------|
| copy host->device                        | memcpy        | i+2   |
| input_dist::start (splits all-to-all)    | data_dist     | i+1   |
| input_dist::splits (values all-to-all)   | data_dist     | i+1   |
| forward (input_dist::wait of i inside)   | current       | i     |
| backward, optimizer                      | current       | i     |

The table shows the "early" input_dist schedule: the splits of batch i+1 are waited for before
forward of i, so its values all-to-all is under way during the whole forward, backward and optimizer
step of i, on a process group of its own so that backward's collectives do not queue behind it. The
"late" schedule is torchrec's: the splits are waited for after forward, on torchrec's group;
"early-shared" and "late-own" make the two choices the other way round. "auto" (the default)
measures them in paired rounds over the first training steps and keeps torchrec's order unless
another is significantly faster (`pipeline.stages.schedule`). With `enqueue_batch_after_forward`, the copy
of batch i+2 moves after forward of i, as in torchrec. On CPU the collectives run in gloo's
threads, so the overlap is real there too.
"""

from __future__ import annotations

from typing import Any

from pipeline.compat.signatures import Bound
from pipeline.pipelines.input_dist_core import InputDistPipeline
from pipeline.ranks import Lane

__all__ = ["TrainPipelineSparseDist"]


class TrainPipelineSparseDist(InputDistPipeline):
    """Overlaps input_dist of batch i+1 and the copy of batch i+2 with the compute of batch i.

    Args (torchrec 1.8's, in its order, then ours, keyword-only; `pipeline.compat.signatures` has the list):
        model: usually a DistributedModelParallel; returns `(loss, output)` in training mode.
        optimizer: stepped after each training batch's backward.
        device: where batches are copied to.
        execute_all_batches: run the batches in flight once the dataloader is exhausted (True), or
            drop the last two as torchrec does (False).
        apply_jit: not supported; must be False. context_type: accepted, unused.
        pipeline_postproc, arg_paths, rewrite_method, strict: `RewriteOptions`.
        custom_model_fwd: called with the batch instead of `model`.
        dmp_collection_sync_interval_batches, enqueue_batch_after_forward: `StepOptions`.
        enable_inplace_copy_batch, free_features_storage_early, clear_data_dist_inputs:
            `MemoryOptions`.
        input_dist_schedule, tuner: `InputDistOptions`.
        streams, on_uneven, check_keys, agreement, abort_on_error, failure_grace, peer_timeout:
            the streams and `RankOptions`.
    """

    def _compose(self, bound: Bound) -> None:
        self._lookahead = 2  # torchrec's fetches batch i+2 during step i and stops when it is missing
        self._input_dist = self._make_input_dist(bound.options, forward="input_dist")

    def _fill(self, lane: Lane) -> None:
        self._input_dist.fill(lane, self._ranks, self._enqueue)

    def _step(self, lane: Lane) -> Any:
        ctx = lane.inflight[0]
        input_dist = self._input_dist
        input_dist.choose_schedule(self._model.training)
        input_dist.release_inputs(ctx)
        copy_late = self._options.step.enqueue_batch_after_forward
        if not copy_late and len(lane.inflight) < 3:
            self._enqueue(lane)
        nxt = input_dist.start_next(lane, self._ranks)
        losses, output = self._forward(ctx, train=True, slot=input_dist.slot)
        if copy_late and len(lane.inflight) < 3:
            self._enqueue(lane)  # after forward: on a GPU the copy does not compete with lookups
        input_dist.finish_next(lane, self._ranks, nxt, fetched_before=not copy_late)
        if losses is not None:
            self._backward(ctx, losses)
            self._sync_replicas(ctx)
            self._optimizer_step(ctx)
        input_dist.retire_head(lane, self._ranks, nxt, read_next=copy_late)
        return output
