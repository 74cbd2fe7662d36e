"""TrainPipelinePEC: torchrec 1.9's pipeline for models with PEC embedding collections, with the
embedding lookup of batch i at the top of step i (`pipeline.stages.lookup.LookupStage`).

torchrec's class (CUDA only) also splits the ids of each `ShardedPECEmbeddingCollection` by whether
they recur in the next batch (looked up in step i, the others a step ahead). Here every sharded
module, PEC modules included, is looked up whole: the plain loop's numbers, without that split; a
note in `rewrite_report` names the PEC modules it would have applied to. The same class on torchrec
1.8 (PEC modules, no TrainPipelinePEC) and 1.9 (docs/reference.md, "TrainPipelinePEC").
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from pipeline.config import InputDistOptions, RankOptions, RewriteOptions
from pipeline.pipelines.sparse_dist import TrainPipelineSparseDist
from pipeline.ranks import Lane
from pipeline.stages.context import LookupBatchContext
from pipeline.stages.lookup import LookupStage
from pipeline.stages.streams import Streams

try:
    from torchrec.distributed.pec_embedding import ShardedPECEmbeddingCollection
except ImportError:  # a torchrec without PEC modules
    ShardedPECEmbeddingCollection = None

__all__ = ["TrainPipelinePEC", "pec_modules"]


def pec_modules(model: torch.nn.Module) -> list[str]:
    """The FQNs of the `ShardedPECEmbeddingCollection`s in `model` (none where torchrec has none)."""
    if ShardedPECEmbeddingCollection is None:
        return []
    return [fqn for fqn, m in model.named_modules() if isinstance(m, ShardedPECEmbeddingCollection)]


class TrainPipelinePEC(TrainPipelineSparseDist):
    """SparseDist whose embedding lookup of batch i runs at the top of step i, for every sharded
    module (PEC modules looked up whole: torchrec's split of their ids is not done, see the module).

    Numerics: bit for bit the plain loop's (zero_grad, forward, backward, step per batch), for
    fused embedding optimizers; where a sharded module has parameters in the dense optimizer the
    lookup waits for the optimizer step.

    Args (torchrec's, in its order, then ours, keyword-only): as in `TrainPipelineSparseDist`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        custom_model_fwd: Callable[[Any], tuple[torch.Tensor, Any]] | None = None,
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
            pipeline_postproc=False,  # torchrec's class passes SparseDist's default
            forward="lookup",
            batch_context=LookupBatchContext,
        )
        self._lookup = LookupStage(self._streams, self._input_dist, model, optimizer)
        self._noted = False

    def _fill(self, lane: Lane) -> None:
        self._input_dist.fill(lane, self._enqueue)
        rewrite = self._input_dist.rewrite
        if not self._noted and rewrite is not None and not rewrite.needs_recording:  # the final report
            self._noted = True
            report = rewrite.report
            pec = pec_modules(self._model)
            if pec:
                report.notes.append(
                    f"PEC modules {', '.join(pec)}: looked up whole at the top of the step, as the "
                    "other sharded modules (the plain loop's numbers); torchrec's split of their ids "
                    "by recurrence in the next batch is not implemented here"
                )

    def _step(self, lane: Lane) -> Any:
        ctx = lane.inflight[0]
        input_dist, lookup = self._input_dist, self._lookup
        input_dist.choose_schedule(self._model.training)
        if len(lane.inflight) < 3:
            self._enqueue(lane)  # the copy of i+2 first, as torchrec's step
        lookup.run(ctx)  # the lookup of i, at the top of the step
        nxt = input_dist.start_next(lane)
        # torchrec's PEC step does not call `_wait_for_batch`; the copy is still waited for
        self._wait_copied(ctx.batch)
        losses, output = self._forward(ctx, train=True, input_dist=input_dist)
        if nxt is not None:
            input_dist.wait_splits(nxt)  # a no-op after early splits
        if losses is not None:
            lookup.backward_and_step(
                losses, lambda losses: self._backward_stage(ctx, losses), lambda: self._optimizer_stage(ctx)
            )
        lane.inflight.popleft()
        return output
