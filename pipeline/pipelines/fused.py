"""TrainPipelineFusedSparseDist: the embedding lookup of batch i runs at the start of step i, ahead of
forward (`pipeline.stages.lookup.LookupStage`; stages and streams: `pipeline.stages`).

On CUDA the lookup of batch i overlaps the dense optimizer step of batch i-1, as in torchrec; on CPU
its pooled-embedding all-to-all overlaps the input_dist start of i+1, the copy of i+2 and the part
of forward before the embeddings are used.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from pipeline.compat.methods import FusedMethods
from pipeline.config import InputDistOptions, RankOptions, RewriteOptions
from pipeline.pipelines.sparse_dist import TrainPipelineSparseDist
from pipeline.ranks import Lane
from pipeline.stages.context import LookupBatchContext
from pipeline.stages.lookup import LookupStage
from pipeline.stages.streams import Streams

__all__ = ["LOOKUP_STREAMS", "TrainPipelineFusedSparseDist"]

LOOKUP_STREAMS = ("data_dist", "new", "current")


class TrainPipelineFusedSparseDist(FusedMethods, TrainPipelineSparseDist):
    """SparseDist whose embedding lookup of batch i runs at the start of step i, ahead of forward.

    Numerics: bit for bit the plain loop's (zero_grad, forward, backward, step per batch), for
    fused embedding optimizers. Where a sharded module has parameters in the dense optimizer
    (feature processors), the lookup waits for the optimizer step, so the numerics stay exact
    (torchrec's class does not wait and warns that this case is not exact).

    Args (torchrec's, in its order; the rest, and our keyword-only ones, as in `TrainPipelineSparseDist`):
        emb_lookup_stream: "data_dist" or "new": the lookup runs on the data_dist stream;
            "current": on the caller's.
        embedding_lookup_after_data_dist: run the lookup of i after starting input_dist of i+1
            and copying i+2, instead of first.
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
        strict: bool = False,
        emb_lookup_stream: str = "data_dist",
        embedding_lookup_after_data_dist: bool = False,
        enable_inplace_copy_batch: bool = False,
        enqueue_batch_after_forward: bool = False,
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
        if emb_lookup_stream not in LOOKUP_STREAMS:
            raise ValueError(f"emb_lookup_stream must be one of {LOOKUP_STREAMS}; got {emb_lookup_stream!r}")
        self._build(locals(), forward="lookup", batch_context=LookupBatchContext)
        self._lookup = LookupStage(
            self._streams,
            self._input_dist,
            model,
            optimizer,
            on_caller_stream=emb_lookup_stream == "current",
        )
        self._lookup_first = not embedding_lookup_after_data_dist

    def _step(self, lane: Lane) -> Any:
        ctx = lane.inflight[0]
        input_dist, lookup = self._input_dist, self._lookup
        if self._lookup_first:
            lookup.run(ctx)
        input_dist.choose_schedule(self._model.training)
        copy_late = self._enqueue_batch_after_forward
        if not copy_late and len(lane.inflight) < 3:
            self._enqueue(lane)
        nxt = input_dist.start_next(lane)
        lookup.run(ctx)  # a no-op when it ran first
        self._wait_for_batch()
        losses, output = self._forward(ctx, train=True, input_dist=input_dist)
        if copy_late and len(lane.inflight) < 3:
            self._enqueue(lane)
        if nxt is not None:
            input_dist.wait_splits(nxt)  # a no-op after early splits
        if losses is not None:
            lookup.backward_and_step(
                losses, lambda losses: self._backward_stage(ctx, losses), lambda: self._optimizer_stage(ctx)
            )
        lane.inflight.popleft()
        return output
