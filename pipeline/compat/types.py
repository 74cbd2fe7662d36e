"""torchrec's base class and type variables, re-exported: every pipeline class is a torchrec
`TrainPipeline`, generic over torchrec's `In` (a pipeline's batch) and `Out` (its output), and a
`PipelineStage`'s output is torchrec's `StageOut`."""

from __future__ import annotations

from torchrec.distributed.train_pipeline.pipeline_context import In, Out
from torchrec.distributed.train_pipeline.pipeline_stage import StageOut
from torchrec.distributed.train_pipeline.train_pipelines import TrainPipeline

__all__ = ["In", "Out", "StageOut", "TrainPipeline"]
