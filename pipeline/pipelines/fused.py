"""TrainPipelineFusedSparseDist: the embedding lookup of batch i runs at the start of step i, ahead of
forward (`pipeline.stages.lookup.LookupStage`).

Per `progress()` call that returns batch i: lookup of i (data_dist stream), input_dist of i+1, copy
of i+2, forward of i (which takes the lookup's output), backward, optimizer step. On CUDA the lookup
of batch i overlaps the dense optimizer step of batch i-1, as in torchrec 1.8; on CPU its
pooled-embedding all-to-all overlaps the input_dist start of i+1, the copy of i+2 and the part of
forward before the embeddings are used.
"""

from __future__ import annotations

from typing import Any

from pipeline.compat.signatures import Bound
from pipeline.stages.context import LookupBatchContext
from pipeline.pipelines.input_dist_core import InputDistPipeline
from pipeline.stages.lookup import LookupStage
from pipeline.ranks import Lane
from pipeline.pipelines.sparse_dist import TrainPipelineSparseDist

__all__ = ["TrainPipelineFusedSparseDist"]


class TrainPipelineFusedSparseDist(InputDistPipeline):
    """SparseDist whose embedding lookup of batch i runs at the start of step i, ahead of forward.

    Numerics: bit for bit the plain loop's (zero_grad, forward, backward, step per batch), for
    fused embedding optimizers. Where a sharded module has parameters in the dense optimizer
    (feature processors), the lookup waits for the optimizer step, so the numerics stay exact
    (torchrec's class does not wait and warns that this case is not exact).

    Args: torchrec 1.8's, in its order (`pipeline.compat.signatures`): those of `TrainPipelineSparseDist` it
    has, `strict`, `emb_lookup_stream` ("data_dist" or "new": the data_dist stream; "current": the
    caller's), `embedding_lookup_after_data_dist` (the lookup of i after starting input_dist of i+1
    and copying i+2, instead of first), `enqueue_batch_after_forward` and the three memory flags;
    then ours, keyword-only: `arg_paths`, `rewrite_method`, `input_dist_schedule`, `tuner`,
    `streams` and `RankOptions`.
    """

    def _compose(self, bound: Bound) -> None:
        options = bound.options
        self._context_type = LookupBatchContext
        self._lookahead = 2
        self._input_dist = self._make_input_dist(options, forward="lookup")
        self._lookup = LookupStage(
            self._streams,
            self._input_dist,
            self._model,
            self._optimizer,
            on_caller_stream=options.lookup.emb_lookup_stream == "current",
        )
        self._lookup_first = not options.lookup.embedding_lookup_after_data_dist

    def _fill(self, lane: Lane) -> None:
        self._input_dist.fill(lane, self._ranks, self._enqueue)

    def _step(self, lane: Lane) -> Any:
        ctx = lane.inflight[0]
        input_dist, lookup = self._input_dist, self._lookup
        if self._lookup_first:
            lookup.run(ctx)
        input_dist.choose_schedule(self._model.training)
        copy_late = self._options.step.enqueue_batch_after_forward
        if not copy_late and len(lane.inflight) < 3:
            self._enqueue(lane)
        nxt = input_dist.start_next(lane, self._ranks)
        lookup.run(ctx)  # a no-op when it ran first
        losses, output = self._forward(ctx, train=True, slot=input_dist.slot)
        if copy_late and len(lane.inflight) < 3:
            self._enqueue(lane)
        input_dist.finish_next(lane, self._ranks, nxt, fetched_before=not copy_late)
        if losses is not None:
            lookup.backward_and_step(
                losses, lambda losses: self._backward(ctx, losses), lambda: self._optimizer_step(ctx)
            )
        input_dist.retire_head(lane, self._ranks, nxt, read_next=copy_late)
        return output


# torchrec's class derives from its TrainPipelineSparseDist: `isinstance` answers as it does there,
# without inheriting a step to override
TrainPipelineSparseDist.register(TrainPipelineFusedSparseDist)
