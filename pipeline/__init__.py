"""Pipelined training for sharded TorchRec models, a drop-in for torchrec's train_pipeline package.

The classes (one family a module of `pipeline.pipelines`): `TrainPipelineBase` overlaps the
host-to-device copy, `TrainPipelineSparseDist` adds input_dist (all-to-all) ahead of forward,
`PrefetchTrainPipelineSparseDist` adds a prefetch stage so forward never waits on communication,
`TrainPipelineFusedSparseDist` runs the embedding lookup ahead of forward, `TrainPipelineSemiSync`
the next batch's lookup before this batch's backward (embeddings one step stale),
`EvalPipelineSparseDist` is forward only, `StagedTrainPipeline` runs the caller's own stages
(`SparseDataDistUtil` makes the input_dist one), `TrainPipelinePT2` compiles the model and
`TrainPipelineSparseDistCompAutograd` compiles the backward. Stages and streams: `pipeline.stages`.

Every class is a torchrec `TrainPipeline` and takes torchrec's parameters in torchrec's order, then
ours, keyword-only; our options are also `pipeline.config` objects (`RankOptions`,
`RewriteOptions`, `InputDistOptions`, `PrefetchOptions`). torchrec's other public names of its
train_pipeline package are here too (`ArgInfo`, `CallArgs`, `ArgInfoStepFactory`, `Tracer`,
`DataLoadingThread`, `TrainPipelineContext`, `In`, `Out`, `StageOut`, gradient accumulation).
"""

from pipeline.compat.data_loading import DataLoadingThread
from pipeline.compat.types import In, Out, StageOut, TrainPipeline
from pipeline.config import (
    InputDistOptions,
    PrefetchOptions,
    RankOptions,
    RewriteOptions,
    TorchCompileConfig,
)
from pipeline.pipelines.base import TrainPipelineBase
from pipeline.pipelines.comp_autograd import TrainPipelineSparseDistCompAutograd
from pipeline.pipelines.eval import EvalPipelineSparseDist
from pipeline.pipelines.fused import TrainPipelineFusedSparseDist
from pipeline.pipelines.gradient_accumulation import (
    GradientAccumulationConfig,
    GradientAccumulationWrapper,
)
from pipeline.pipelines.prefetch import PrefetchTrainPipelineSparseDist
from pipeline.pipelines.pt2 import TrainPipelinePT2
from pipeline.pipelines.semi_sync import TrainPipelineSemiSync
from pipeline.pipelines.sparse_dist import TrainPipelineSparseDist
from pipeline.pipelines.staged import PipelineStage, SparseDataDistUtil, StagedTrainPipeline
from pipeline.ranks import (
    AgreedError,
    BatchKeysError,
    MalformedBatchError,
    PeerFailedError,
    UnevenDataError,
)
from pipeline.stages.context import TrainPipelineContext
from pipeline.stages.not_pipelined import NotPipelinedWarning
from pipeline.stages.streams import CudaStreams, Streams
from pipeline.stages.thread_streams import ThreadStreams
from pipeline.stages.tuner import Tuner
from pipeline.testing import HandoffError, RecordingStreams
from rewrite import NotPreparedError, RewriteError
from rewrite.torchrec_args import ArgInfo, ArgInfoStepFactory, CallArgs
from rewrite.trace import Tracer

__all__ = [
    "AgreedError",
    "ArgInfo",
    "ArgInfoStepFactory",
    "BatchKeysError",
    "CallArgs",
    "CudaStreams",
    "DataLoadingThread",
    "EvalPipelineSparseDist",
    "GradientAccumulationConfig",
    "GradientAccumulationWrapper",
    "HandoffError",
    "In",
    "InputDistOptions",
    "MalformedBatchError",
    "NotPipelinedWarning",
    "NotPreparedError",
    "Out",
    "PeerFailedError",
    "PipelineStage",
    "PrefetchOptions",
    "PrefetchTrainPipelineSparseDist",
    "RankOptions",
    "RecordingStreams",
    "RewriteError",
    "RewriteOptions",
    "SparseDataDistUtil",
    "StageOut",
    "StagedTrainPipeline",
    "Streams",
    "ThreadStreams",
    "TorchCompileConfig",
    "Tracer",
    "TrainPipeline",
    "TrainPipelineBase",
    "TrainPipelineContext",
    "TrainPipelineFusedSparseDist",
    "TrainPipelinePT2",
    "TrainPipelineSemiSync",
    "TrainPipelineSparseDist",
    "TrainPipelineSparseDistCompAutograd",
    "Tuner",
    "UnevenDataError",
]
