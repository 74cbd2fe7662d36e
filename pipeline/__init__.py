"""Pipelined training for sharded TorchRec models, a drop-in for torchrec's train_pipeline package:
its public names, every pipeline a torchrec `TrainPipeline` taking torchrec's parameters, then our
`pipeline.options` keyword-only (docs/pipeline.md, "Which pipeline", says which class to use)."""

from pipeline.compat import In, ModelDetachedException, Out, PipelineState, StageOut, TrainPipeline
from pipeline.compat.backward_injection import (
    BackwardHookWork,
    FirstGradTensorFinder,
    GradTensorFinder,
    InjectionSite,
    InjectionTargetType,
    OutputDistTensorFinder,
    register_backward_hook,
    will_hook_fire,
)
from pipeline.compat.data_loading import DataLoadingThread
from pipeline.options import (
    InputDistOptions,
    PrefetchOptions,
    RankOptions,
    RewriteOptions,
    TorchCompileConfig,
)
from pipeline.pipelines.base import TrainPipelineBase
from pipeline.pipelines.experimental import (
    EvalPipelineCPUSparse,
    TrainEvalHybridPipelineBase,
    TrainPipelineSparseDistT,
)
from pipeline.pipelines.gradient_accumulation import (
    GradientAccumulationConfig,
    GradientAccumulationWrapper,
)
from pipeline.pipelines.in_backward import (
    StepPlacement,
    TrainPipelinePrefetchEMS,
    TrainPipelineSparseDistBwdOpt,
    TrainPipelineSparseDistEmbStash,
    TrainPipelineSparseDistOptStash,
)
from pipeline.pipelines.lookups import (
    EvalPipelineFusedSparseDist,
    TrainPipelineFusedSparseDist,
    TrainPipelinePEC,
    TrainPipelineSemiSync,
)
from pipeline.pipelines.prefetch import PrefetchTrainPipelineSparseDist
from pipeline.pipelines.pt2 import TrainPipelinePT2, TrainPipelineSparseDistCompAutograd
from pipeline.pipelines.sparse_dist import (
    EvalPipelineSparseDist,
    TrainPipelineSparseDist,
    TrainPipelineSparseDistLite,
)
from pipeline.pipelines.staged import PipelineStage, SparseDataDistUtil, StagedTrainPipeline
from pipeline.ranks import (
    AgreedError,
    BatchKeysError,
    MalformedBatchError,
    PeerFailedError,
    StopIterationInStepError,
    UnevenDataError,
)
from pipeline.stages.context import TrainPipelineContext
from pipeline.stages.input_dist import NotPipelinedWarning
from pipeline.stages.prefetch import PrefetchWatch
from pipeline.stages.schedule import ScheduleWatch
from pipeline.stages.streams import CudaStreams, Streams, ThreadStreams
from rewrite import NotPreparedError, RewriteError
from rewrite.torchrec_args import ArgInfo, ArgInfoStepFactory, CallArgs
from rewrite.trace import Tracer

__all__ = [
    "AgreedError",
    "ArgInfo",
    "ArgInfoStepFactory",
    "BackwardHookWork",
    "BatchKeysError",
    "CallArgs",
    "CudaStreams",
    "DataLoadingThread",
    "EvalPipelineCPUSparse",
    "EvalPipelineFusedSparseDist",
    "EvalPipelineSparseDist",
    "FirstGradTensorFinder",
    "GradTensorFinder",
    "GradientAccumulationConfig",
    "GradientAccumulationWrapper",
    "In",
    "InjectionSite",
    "InjectionTargetType",
    "InputDistOptions",
    "MalformedBatchError",
    "ModelDetachedException",
    "NotPipelinedWarning",
    "NotPreparedError",
    "Out",
    "OutputDistTensorFinder",
    "PeerFailedError",
    "PipelineStage",
    "PipelineState",
    "PrefetchOptions",
    "PrefetchTrainPipelineSparseDist",
    "PrefetchWatch",
    "RankOptions",
    "RewriteError",
    "RewriteOptions",
    "ScheduleWatch",
    "SparseDataDistUtil",
    "StageOut",
    "StagedTrainPipeline",
    "StepPlacement",
    "StopIterationInStepError",
    "Streams",
    "ThreadStreams",
    "TorchCompileConfig",
    "Tracer",
    "TrainEvalHybridPipelineBase",
    "TrainPipeline",
    "TrainPipelineBase",
    "TrainPipelineContext",
    "TrainPipelineFusedSparseDist",
    "TrainPipelinePEC",
    "TrainPipelinePT2",
    "TrainPipelinePrefetchEMS",
    "TrainPipelineSemiSync",
    "TrainPipelineSparseDist",
    "TrainPipelineSparseDistBwdOpt",
    "TrainPipelineSparseDistCompAutograd",
    "TrainPipelineSparseDistEmbStash",
    "TrainPipelineSparseDistLite",
    "TrainPipelineSparseDistOptStash",
    "TrainPipelineSparseDistT",
    "UnevenDataError",
    "register_backward_hook",
    "will_hook_fire",
]
