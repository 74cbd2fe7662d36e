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

import torch
from torch import nn

from pipeline.sparse_dist import TrainPipelineSparseDist

__all__ = ["EvalPipelineSparseDist"]


class EvalPipelineSparseDist(TrainPipelineSparseDist):
    """Forward-only pipeline: input_dist of batch i+1 and the copy of batch i+2 overlap forward of i.

    Numerics: each output is bit for bit the model's own output for that batch (`model(batch)` in
    the same mode, under `no_grad`); no parameter changes. The model's mode is left as it is (as in
    torchrec, call `model.eval()` first for eval-mode layers); forward always runs under `no_grad`
    and `progress()` returns `output` of a `(loss, output)` pair, or any other return value as it is.

    Args:
        model: usually a DistributedModelParallel.
        optimizer: not used (kept for torchrec's signature).
        device: where batches are copied to.
        apply_jit: not supported (kept for torchrec's signature); must be False.
        pipeline_postproc: run parameter-free modules that transform the batch ahead with
            input_dist (see `TrainPipelineSparseDist`).
        enable_inplace_copy_batch, free_features_storage_early, clear_data_dist_inputs: torchrec's
            memory options; accepted and ignored.
        input_dist_schedule: "early-shared" (default), "early", "late" (torchrec's order) or
            "late-own"; "auto" is refused, since the tuner times training steps.
        **options: the other keyword options of `TrainPipelineSparseDist` (`arg_paths`,
            `rewrite_method`, `strict`, `streams`, `on_uneven`, `check_keys`, `agreement`, ...).
    """

    _trains = False

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        device: torch.device,
        apply_jit: bool = False,
        pipeline_postproc: bool = False,
        enable_inplace_copy_batch: bool = False,
        free_features_storage_early: bool = False,
        clear_data_dist_inputs: bool = False,
        *,
        input_dist_schedule: str = "early-shared",
        **options: Any,
    ) -> None:
        if input_dist_schedule == "auto":
            raise ValueError(
                'EvalPipelineSparseDist takes a fixed input_dist_schedule; "auto" tunes training'
            )
        super().__init__(
            model,
            optimizer,  # type: ignore[arg-type]
            device,
            True,
            apply_jit,
            None,
            pipeline_postproc,
            input_dist_schedule=input_dist_schedule,
            **options,
        )
