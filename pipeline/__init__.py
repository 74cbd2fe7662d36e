"""Pipelined training for sharded TorchRec models, a drop-in for torchrec's train_pipeline package.

The classes (one family a module of `pipeline.pipelines`): `TrainPipelineBase` overlaps the
host-to-device copy, `TrainPipelineSparseDist` adds input_dist (all-to-all) ahead of forward,
`PrefetchTrainPipelineSparseDist` adds a prefetch stage so forward never waits on communication,
`TrainPipelineFusedSparseDist` runs the embedding lookup ahead of forward, `TrainPipelineSemiSync`
the next batch's lookup before this batch's backward (embeddings one step stale),
`EvalPipelineSparseDist` is forward only, `StagedTrainPipeline` runs the caller's own stages
(`SparseDataDistUtil` makes the input_dist one), `TrainPipelinePT2` compiles the model and
`TrainPipelineSparseDistCompAutograd` compiles the backward. Beside them, torchrec's classes outside
its package's exports: `TrainPipelineSparseDistLite` (one batch in flight),
`TrainPipelineSparseDistT` (the copy dispatched from a thread), `TrainEvalHybridPipelineBase`
(training and evaluation batches in one pipeline), `EvalPipelineFusedSparseDist` (forward only, the
lookup ahead), `EvalPipelineCPUSparse` (host embeddings, device forward), `TrainPipelinePEC` (every
module looked up at the top of the step) and `TrainPipelineSparseDistBwdOpt` (the dense step inside
backward). Stages and streams: `pipeline.stages`.

Every class is a torchrec `TrainPipeline` and takes torchrec's parameters in torchrec's order, then
ours, keyword-only; our options are also `pipeline.config` objects (`RankOptions`,
`RewriteOptions`, `InputDistOptions`, `PrefetchOptions`). torchrec's other public names of its
train_pipeline package are here too (`ArgInfo`, `CallArgs`, `ArgInfoStepFactory`, `Tracer`,
`DataLoadingThread`, `TrainPipelineContext`, `In`, `Out`, `StageOut`, gradient accumulation).
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
    UnevenDataError,
)
from pipeline.stages.backward_step import StepPlacement
from pipeline.stages.context import TrainPipelineContext
from pipeline.stages.not_pipelined import NotPipelinedWarning
from pipeline.stages.overlap import OverlapTrial
from pipeline.stages.streams import CudaStreams, Streams
from pipeline.stages.thread_streams import ThreadStreams
from pipeline.stages.tuner import Tuner
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
    "OverlapTrial",
    "PeerFailedError",
    "PipelineStage",
    "PipelineState",
    "PrefetchOptions",
    "PrefetchTrainPipelineSparseDist",
    "RankOptions",
    "RewriteError",
    "RewriteOptions",
    "SparseDataDistUtil",
    "StageOut",
    "StagedTrainPipeline",
    "StepPlacement",
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
    "Tuner",
    "UnevenDataError",
    "register_backward_hook",
    "will_hook_fire",
]
