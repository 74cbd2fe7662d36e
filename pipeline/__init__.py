"""Pipelined training for sharded TorchRec models.

`TrainPipelineBase` overlaps the host-to-device copy, `TrainPipelineSparseDist` adds input_dist
(all-to-all) ahead of forward, `PrefetchTrainPipelineSparseDist` adds a prefetch stage so forward
never waits on communication. The rest of torchrec's family: `TrainPipelineFusedSparseDist` (the
embedding lookup ahead of forward), `TrainPipelineSemiSync` (the next batch's lookup before this
batch's backward: embeddings one step stale), `EvalPipelineSparseDist` (forward only) and
`StagedTrainPipeline` (the caller's own stages; `SparseDataDistUtil` makes the input_dist one).
`TrainPipelinePT2` (the model torch.compile'd after its first steps) and
`TrainPipelineSparseDistCompAutograd` (the backward under compiled autograd) are in `pipeline.pipelines.pt2`.
Every class is a torchrec `TrainPipeline`; constructors (`pipeline.compat.signatures`: torchrec 1.8's
parameters in its order, then our options, keyword-only) and `progress()` follow torchrec's, so a
torchrec user switches by changing an import (docs/pipeline.md, "Which pipeline").

Every other public name of torchrec 1.8's `train_pipeline` package is here too: gradient
accumulation (`GradientAccumulationConfig`, `GradientAccumulationWrapper`), `DataLoadingThread` (a
thread that loads and copies the next batch), torchrec's ArgInfo API (`ArgInfo`, `CallArgs`,
`ArgInfoStepFactory`), its fx `Tracer`, `TrainPipelineContext` (our `BatchContext`) and its type
variables `In`, `Out`, `StageOut` (docs/pipeline.md, "torchrec's other names").

The names are loaded on first use (PEP 562), so the timeline tool (`python -m timeline`), which reads
`pipeline.stages.names`, does not pay for importing torchrec.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "TrainPipeline": "pipeline.compat.signatures",
    "BatchContext": "pipeline.stages.context",
    "PrefetchBatchContext": "pipeline.stages.context",
    "LookupBatchContext": "pipeline.stages.context",
    "TrainPipelineBase": "pipeline.pipelines.base",
    "TrainPipelineSparseDist": "pipeline.pipelines.sparse_dist",
    "PrefetchTrainPipelineSparseDist": "pipeline.pipelines.prefetch",
    "EvalPipelineSparseDist": "pipeline.pipelines.eval",
    "TrainPipelineFusedSparseDist": "pipeline.pipelines.fused",
    "TrainPipelineSemiSync": "pipeline.pipelines.semi_sync",
    "StagedTrainPipeline": "pipeline.pipelines.staged",
    "TrainPipelinePT2": "pipeline.pipelines.pt2",
    "TrainPipelineSparseDistCompAutograd": "pipeline.pipelines.pt2",
    "TorchCompileConfig": "pipeline.config",
    "PipelineStage": "pipeline.pipelines.staged",
    "SparseDataDistUtil": "pipeline.pipelines.staged",
    "InputDist": "pipeline.stages.input_dist",
    "InputDistGroups": "pipeline.stages.input_dist",
    "Streams": "pipeline.stages.streams",
    "CudaStreams": "pipeline.stages.streams",
    "ThreadStreams": "pipeline.stages.streams",
    "RecordingStreams": "pipeline.testing",
    "HandoffError": "pipeline.testing",
    "Tuner": "pipeline.stages.tuner",
    "RankOptions": "pipeline.config",
    "RewriteOptions": "pipeline.config",
    "InputDistOptions": "pipeline.config",
    "PrefetchOptions": "pipeline.config",
    "MemoryOptions": "pipeline.config",
    "StepOptions": "pipeline.config",
    "LookupOptions": "pipeline.config",
    "SemiSyncOptions": "pipeline.config",
    "CompileOptions": "pipeline.config",
    "PipelineOptions": "pipeline.config",
    "Lane": "pipeline.ranks",
    "LaneState": "pipeline.ranks",
    "Status": "pipeline.ranks",
    "AgreedError": "pipeline.ranks",
    "UnevenDataError": "pipeline.ranks",
    "BatchKeysError": "pipeline.ranks",
    "MalformedBatchError": "pipeline.ranks",
    "PeerFailedError": "pipeline.ranks",
    "GradientAccumulationConfig": "pipeline.pipelines.gradient_accumulation",
    "GradientAccumulationWrapper": "pipeline.pipelines.gradient_accumulation",
    "TrainPipelineContext": "pipeline.stages.context",
    "DataLoadingThread": "pipeline.compat.data_loading",
    "ArgInfo": "rewrite.torchrec_args",
    "CallArgs": "rewrite.torchrec_args",
    "ArgInfoStepFactory": "rewrite.torchrec_args",
    "Tracer": "rewrite.trace",
    "In": "pipeline.compat.signatures",
    "Out": "pipeline.compat.signatures",
    "StageOut": "pipeline.compat.signatures",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
