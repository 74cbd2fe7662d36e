"""Pipelined training for sharded TorchRec models, a drop-in for torchrec's train_pipeline package.

Every class (one family a module of `pipeline.pipelines`; README.md's table says which to use) is a
torchrec `TrainPipeline` and takes torchrec's parameters in torchrec's order, then ours,
keyword-only; our options are also `pipeline.config` objects. torchrec's other public names of its
train_pipeline package are here too. Stages and streams: `pipeline.stages`.
"""

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
from pipeline.compat.types import In, ModelDetachedException, Out, PipelineState, StageOut, TrainPipeline
from pipeline.config import (
    InputDistOptions,
    PrefetchOptions,
    RankOptions,
    RewriteOptions,
    TorchCompileConfig,
)
from pipeline.pipelines.backward_opt import TrainPipelineSparseDistBwdOpt
from pipeline.pipelines.base import TrainPipelineBase
from pipeline.pipelines.comp_autograd import TrainPipelineSparseDistCompAutograd
from pipeline.pipelines.copy_thread import TrainPipelineSparseDistT
from pipeline.pipelines.emb_stash import TrainPipelineSparseDistEmbStash
from pipeline.pipelines.eval import EvalPipelineSparseDist
from pipeline.pipelines.eval_cpu import EvalPipelineCPUSparse
from pipeline.pipelines.eval_fused import EvalPipelineFusedSparseDist
from pipeline.pipelines.fused import TrainPipelineFusedSparseDist
from pipeline.pipelines.gradient_accumulation import (
    GradientAccumulationConfig,
    GradientAccumulationWrapper,
)
from pipeline.pipelines.hybrid import TrainEvalHybridPipelineBase
from pipeline.pipelines.lite import TrainPipelineSparseDistLite
from pipeline.pipelines.opt_stash import TrainPipelineSparseDistOptStash
from pipeline.pipelines.pec import TrainPipelinePEC
from pipeline.pipelines.prefetch import PrefetchTrainPipelineSparseDist
from pipeline.pipelines.prefetch_ems import TrainPipelinePrefetchEMS
from pipeline.pipelines.pt2 import TrainPipelinePT2
from pipeline.pipelines.semi_sync import TrainPipelineSemiSync
from pipeline.pipelines.sparse_data_dist import SparseDataDistUtil
from pipeline.pipelines.sparse_dist import TrainPipelineSparseDist
from pipeline.pipelines.staged import PipelineStage, StagedTrainPipeline
from pipeline.ranks import (
    AgreedError,
    BatchKeysError,
    MalformedBatchError,
    PeerFailedError,
    StopIterationInStepError,
    UnevenDataError,
)
from pipeline.stages.backward_step import StepPlacement
from pipeline.stages.context import TrainPipelineContext
from pipeline.stages.cuda_streams import CudaStreams
from pipeline.stages.not_pipelined import NotPipelinedWarning
from pipeline.stages.prefetch_watch import PrefetchWatch
from pipeline.stages.streams import Streams
from pipeline.stages.thread_streams import ThreadStreams
from pipeline.stages.watch import ScheduleWatch
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
