"""What is here only for torchrec: its `TrainPipeline`, `In`, `Out`, `StageOut`, `PipelineState` and
`ModelDetachedException` re-exported (annotations and `except` clauses match torchrec's), and checks
of torchrec arguments that mean something else here."""

from __future__ import annotations

from torch import nn
from torchrec.distributed.model_parallel import DMPCollection
from torchrec.distributed.train_pipeline.pipeline_context import In, Out
from torchrec.distributed.train_pipeline.pipeline_stage import StageOut
from torchrec.distributed.train_pipeline.train_pipelines import ModelDetachedException, TrainPipeline
from torchrec.distributed.train_pipeline.types import PipelineState

__all__ = ["In", "ModelDetachedException", "Out", "PipelineState", "StageOut", "TrainPipeline"]
__all__ += ["refuse_jit", "sync_interval"]


def refuse_jit(apply_jit: bool) -> None:
    """Raises ValueError if `apply_jit` (torchrec's TorchScript option, not supported here)."""
    if apply_jit:
        raise ValueError("apply_jit=True is not supported (no TorchScript); leave it False")


def sync_interval(model: nn.Module, interval: int | None) -> int | None:
    """`dmp_collection_sync_interval_batches` for `model`: None unless it is a DMPCollection.

    Raises:
        ValueError: not None or a positive int; or neither 1 nor None for another model.
    """
    if interval is not None and (not isinstance(interval, int) or interval < 1):
        raise ValueError(
            f"dmp_collection_sync_interval_batches must be None or a positive int; got {interval!r}"
        )
    if isinstance(model, DMPCollection):
        return interval
    if interval not in (None, 1):
        raise ValueError(
            f"dmp_collection_sync_interval_batches={interval!r} syncs the replicas of a DMPCollection "
            f"(2D sharding), but the model is a {type(model).__name__}; leave it at 1 or None"
        )
    return None
