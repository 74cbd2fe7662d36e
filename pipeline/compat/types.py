"""torchrec's base class, type variables and state enum, re-exported: every pipeline class is a
torchrec `TrainPipeline`, generic over torchrec's `In` (a pipeline's batch) and `Out` (its output), a
`PipelineStage`'s output is torchrec's `StageOut`, and `PipelineState` is the enum torchrec's
`TrainPipeline` keeps in `_state` (the classes that set it here set it as torchrec's do).
`ModelDetachedException` is torchrec's too, so that a user's `except` catches the same class."""

from __future__ import annotations

from torchrec.distributed.train_pipeline.pipeline_context import In, Out
from torchrec.distributed.train_pipeline.pipeline_stage import StageOut
from torchrec.distributed.train_pipeline.train_pipelines import ModelDetachedException, TrainPipeline
from torchrec.distributed.train_pipeline.types import PipelineState

__all__ = ["In", "ModelDetachedException", "Out", "PipelineState", "StageOut", "TrainPipeline"]
