"""EvalPipelineSparseDist: forward only, with the next batch's input_dist running ahead (stages and
streams: `pipeline.stages`; no backward, no optimizer).

With the default "early-shared" schedule the splits of batch i+1 are waited for before forward of i,
so its values all-to-all runs during that forward; torchrec's order ("late") waits them after
forward, which leaves only the splits hidden. Without backward there are no collectives of backward
to queue behind the transfer, so the input all-to-alls stay on torchrec's process group.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from pipeline.config import InputDistOptions, RankOptions, RewriteOptions, resolve
from pipeline.pipelines.sparse_dist import TrainPipelineSparseDist
from pipeline.ranks import Lane
from pipeline.stages.streams import Streams

__all__ = ["EvalPipelineSparseDist", "eval_schedule"]


def eval_schedule(input_dist: InputDistOptions | None, schedule: str | None) -> InputDistOptions:
    """The input_dist options of an eval pipeline: "early-shared" unless given."""
    default = InputDistOptions(schedule="early-shared")
    return resolve(input_dist or default, InputDistOptions, schedule=schedule)


class EvalPipelineSparseDist(TrainPipelineSparseDist):
    """Forward-only pipeline: input_dist of batch i+1 and the copy of batch i+2 overlap forward of i.

    Numerics: each output is bit for bit the model's own output for that batch (`model(batch)` in
    the same mode, under `no_grad`); no parameter changes. The model's mode is left as it is (as in
    torchrec, call `model.eval()` first for eval-mode layers); forward always runs under `no_grad`
    and `progress()` returns `output` of a `(loss, output)` pair, or any other return value as it is.

    Args (torchrec's, in its order, then ours, keyword-only): as in `TrainPipelineSparseDist`
    (`optimizer` is not used); `input_dist_schedule` is "early-shared" by default.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        device: torch.device,
        apply_jit: bool = False,
        pipeline_postproc: bool = False,
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
        self._build(
            locals(),
            input_dist=eval_schedule(input_dist, input_dist_schedule),
            lookahead=0,
        )

    def _step(self, lane: Lane) -> Any:
        ctx, input_dist = lane.inflight[0], self._input_dist
        input_dist.release_inputs(ctx)
        if len(lane.inflight) < 3:
            self._enqueue(lane)
        nxt = input_dist.start_next(lane)
        self._wait_for_batch()
        _, output = self._forward(ctx, train=False, input_dist=input_dist)
        if nxt is not None:
            input_dist.wait_splits(nxt)  # a no-op after early splits
        lane.inflight.popleft()
        return output
