"""EvalPipelineFusedSparseDist: forward only, with the embedding lookup run ahead of forward as in
`TrainPipelineFusedSparseDist` (the Fused column of `pipeline.stages`, without backward and
optimizer): at the start of step i (or after the input_dist start of i+1,
`embedding_lookup_after_data_dist`), or with `enable_embedding_lookup_prefetch` one batch ahead,
right after forward of i for batch i+1 (on a GPU it then overlaps forward of i, at the price of two
batches' embedding outputs alive at once). Nothing is trained: every order gives the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from pipeline.config import InputDistOptions, RankOptions, RewriteOptions
from pipeline.pipelines.eval import eval_schedule
from pipeline.pipelines.fused import LOOKUP_STREAMS, TrainPipelineFusedSparseDist
from pipeline.ranks import Lane
from pipeline.stages.context import LookupBatchContext
from pipeline.stages.lookup import LookupStage
from pipeline.stages.streams import Streams

__all__ = ["EvalPipelineFusedSparseDist"]


class EvalPipelineFusedSparseDist(TrainPipelineFusedSparseDist):
    """Forward-only pipeline whose embedding lookup runs ahead of forward.

    Numerics: each output is bit for bit the model's own output for that batch (`model(batch)`
    under `no_grad`, in the model's mode, which is left as it is); no parameter or gradient
    changes. Forward always runs under `no_grad` and `progress()` returns `output` of a
    `(loss, output)` pair (any other return value as it is).

    Args (torchrec's, in its order, then its keyword; the others as in `TrainPipelineFusedSparseDist`,
    `optimizer` not used; ours, keyword-only, as in `EvalPipelineSparseDist`):
        enqueue_batch_after_forward: copy batch i+2 after forward of i (torchrec's eval class
            accepts it and copies before forward all the same).
        enable_embedding_lookup_prefetch: look batch i+1 up right after forward of i.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
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
        enable_embedding_lookup_prefetch: bool = False,
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
        self._build(
            locals(),
            input_dist=eval_schedule(input_dist, input_dist_schedule),
            forward="lookup",
            batch_context=LookupBatchContext,
        )
        self._lookup = LookupStage(
            self._streams,
            self._input_dist,
            model,
            optimizer,
            on_caller_stream=emb_lookup_stream == "current",
            forward_only=True,
        )
        self._lookup_ahead = enable_embedding_lookup_prefetch
        self._lookup_first = enable_embedding_lookup_prefetch or not embedding_lookup_after_data_dist

    def _step(self, lane: Lane) -> Any:
        ctx = lane.inflight[0]
        input_dist, lookup = self._input_dist, self._lookup
        if self._lookup_first:
            lookup.run(ctx)  # looking ahead: a no-op but for a lane's first batch
        copy_late = self._enqueue_batch_after_forward
        if not copy_late and len(lane.inflight) < 3:
            self._enqueue(lane)
        nxt = input_dist.start_next(lane)
        lookup.run(ctx)  # a no-op when it ran first
        self._wait_for_batch()
        _, output = self._forward(ctx, train=False, input_dist=input_dist)
        if copy_late and len(lane.inflight) < 3:
            self._enqueue(lane)
        if nxt is not None and not input_dist.wait_splits(nxt):  # a no-op after early splits
            nxt = None  # the ranks dropped it (its status rode on its splits)
        if nxt is not None and self._lookup_ahead:
            lookup.run(nxt)  # batch i+1's lookup, while forward of i runs on the caller's stream
        lane.inflight.popleft()
        return output
