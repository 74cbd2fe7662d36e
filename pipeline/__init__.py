"""Pipelined training for sharded TorchRec models.

`TrainPipelineBase` overlaps the host-to-device copy, `TrainPipelineSparseDist` adds input_dist
(all-to-all) ahead of forward, `PrefetchTrainPipelineSparseDist` adds a prefetch stage so forward
never waits on communication. The rest of torchrec's family: `TrainPipelineFusedSparseDist` (the
embedding lookup ahead of forward), `TrainPipelineSemiSync` (the next batch's lookup before this
batch's backward: embeddings one step stale), `EvalPipelineSparseDist` (forward only) and
`StagedTrainPipeline` (the caller's own stages; `SparseDataDistUtil` makes the input_dist one).
`TrainPipelinePT2` (the model torch.compile'd after its first steps) and
`TrainPipelineSparseDistCompAutograd` (the backward under compiled autograd) are in `pipeline.pt2`.
Every class is a torchrec `TrainPipeline`; constructors (`pipeline.compat`: torchrec 1.8's
parameters in its order, then our options, keyword-only) and `progress()` follow torchrec's, so a
torchrec user switches by changing an import (docs/pipeline.md, "Which pipeline").

Every other public name of torchrec 1.8's `train_pipeline` package is here too: gradient
accumulation (`GradientAccumulationConfig`, `GradientAccumulationWrapper`), `DataLoadingThread` (a
thread that loads and copies the next batch), torchrec's ArgInfo API (`ArgInfo`, `CallArgs`,
`ArgInfoStepFactory`), its fx `Tracer`, `TrainPipelineContext` (our `BatchContext`) and its type
variables `In`, `Out`, `StageOut` (docs/pipeline.md, "torchrec's other names").

The names are loaded on first use (PEP 562), so the timeline tool (`python -m timeline`), which reads
`pipeline.stages`, does not pay for importing torchrec.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "TrainPipeline": "pipeline.compat",
    "BatchContext": "pipeline.context",
    "PrefetchBatchContext": "pipeline.context",
    "LookupBatchContext": "pipeline.context",
    "TrainPipelineBase": "pipeline.base",
    "TrainPipelineSparseDist": "pipeline.sparse_dist",
    "PrefetchTrainPipelineSparseDist": "pipeline.prefetch_sparse_dist",
    "EvalPipelineSparseDist": "pipeline.eval_sparse_dist",
    "TrainPipelineFusedSparseDist": "pipeline.fused_sparse_dist",
    "TrainPipelineSemiSync": "pipeline.semi_sync",
    "StagedTrainPipeline": "pipeline.staged",
    "TrainPipelinePT2": "pipeline.pt2",
    "TrainPipelineSparseDistCompAutograd": "pipeline.pt2",
    "TorchCompileConfig": "pipeline.options",
    "PipelineStage": "pipeline.staged",
    "SparseDataDistUtil": "pipeline.staged",
    "InputDist": "pipeline.input_dist",
    "InputDistGroups": "pipeline.input_dist",
    "Streams": "pipeline.streams",
    "CudaStreams": "pipeline.streams",
    "ThreadStreams": "pipeline.streams",
    "RecordingStreams": "pipeline.testing",
    "HandoffError": "pipeline.testing",
    "Tuner": "pipeline.tuner",
    "RankOptions": "pipeline.options",
    "RewriteOptions": "pipeline.options",
    "InputDistOptions": "pipeline.options",
    "PrefetchOptions": "pipeline.options",
    "MemoryOptions": "pipeline.options",
    "StepOptions": "pipeline.options",
    "LookupOptions": "pipeline.options",
    "SemiSyncOptions": "pipeline.options",
    "CompileOptions": "pipeline.options",
    "PipelineOptions": "pipeline.options",
    "Lane": "pipeline.ranks",
    "LaneState": "pipeline.ranks",
    "Status": "pipeline.ranks",
    "AgreedError": "pipeline.ranks",
    "UnevenDataError": "pipeline.ranks",
    "BatchKeysError": "pipeline.ranks",
    "MalformedBatchError": "pipeline.ranks",
    "PeerFailedError": "pipeline.ranks",
    "GradientAccumulationConfig": "pipeline.gradient_accumulation",
    "GradientAccumulationWrapper": "pipeline.gradient_accumulation",
    "TrainPipelineContext": "pipeline.context",
    "DataLoadingThread": "pipeline.data_loading",
    "ArgInfo": "rewrite.torchrec_args",
    "CallArgs": "rewrite.torchrec_args",
    "ArgInfoStepFactory": "rewrite.torchrec_args",
    "Tracer": "rewrite.trace",
    "In": "pipeline.compat",
    "Out": "pipeline.compat",
    "StageOut": "pipeline.compat",
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
