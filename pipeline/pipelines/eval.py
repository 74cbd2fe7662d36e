"""EvalPipelineSparseDist: forward only, with the next batch's input_dist running ahead.

Per `progress()` call that returns the output of batch i:

| stage                                  | stream (CUDA) | batch |
|----------------------------------------|---------------|-------|
| copy host->device                      | memcpy        | i+2   |
| input_dist::start (splits all-to-all)  | data_dist     | i+1   |
| input_dist::splits (values all-to-all) | data_dist     | i+1   |
| forward (incl. input_dist::wait of i)  | current       | i     |

No backward and no optimizer step, whatever the model's mode. With the default "early-shared"
schedule the splits of batch i+1 are waited for before forward of i, so its values all-to-all runs
during that forward; torchrec's order ("late") waits them after forward, which leaves only the splits
hidden. Without backward there are no collectives of backward to queue behind the transfer, so the
input all-to-alls stay on torchrec's process group.
"""

from __future__ import annotations

from typing import Any

from pipeline.compat.signatures import Bound
from pipeline.pipelines.input_dist_core import InputDistPipeline
from pipeline.ranks import Lane
from pipeline.pipelines.sparse_dist import TrainPipelineSparseDist

__all__ = ["EvalPipelineSparseDist"]


class EvalPipelineSparseDist(InputDistPipeline):
    """Forward-only pipeline: input_dist of batch i+1 and the copy of batch i+2 overlap forward of i.

    Numerics: each output is bit for bit the model's own output for that batch (`model(batch)` in
    the same mode, under `no_grad`); no parameter changes. The model's mode is left as it is (as in
    torchrec, call `model.eval()` first for eval-mode layers); forward always runs under `no_grad`
    and `progress()` returns `output` of a `(loss, output)` pair, or any other return value as it is.

    Args: torchrec 1.8's, in its order (`pipeline.compat.signatures`): model, optimizer (not used), device,
    apply_jit (must be False), pipeline_postproc and the three memory flags; then ours,
    keyword-only: `input_dist_schedule` ("early-shared" by default, "early", "late" or "late-own";
    "auto" is refused, since the tuner times training steps), `arg_paths`, `rewrite_method`,
    `strict`, `streams` and `RankOptions`.
    """

    def _compose(self, bound: Bound) -> None:
        options = bound.options
        if options.input_dist.schedule == "auto":
            raise ValueError(
                'EvalPipelineSparseDist takes a fixed input_dist_schedule; "auto" tunes training'
            )
        self._input_dist = self._make_input_dist(options, forward="input_dist")

    def _fill(self, lane: Lane) -> None:
        self._input_dist.fill(lane, self._ranks, self._enqueue)

    def _step(self, lane: Lane) -> Any:
        ctx, input_dist = lane.inflight[0], self._input_dist
        input_dist.release_inputs(ctx)
        if len(lane.inflight) < 3:
            self._enqueue(lane)
        nxt = input_dist.start_next(lane, self._ranks)
        _, output = self._forward(ctx, train=False, slot=input_dist.slot)
        input_dist.finish_next(lane, self._ranks, nxt, fetched_before=True)
        input_dist.retire_head(lane, self._ranks, nxt, read_next=False)
        return output


# torchrec's class derives from its TrainPipelineSparseDist: `isinstance` answers as it does there,
# without inheriting a step to override
TrainPipelineSparseDist.register(EvalPipelineSparseDist)
