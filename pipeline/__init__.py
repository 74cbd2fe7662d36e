"""Pipelined training for sharded TorchRec models.

`TrainPipelineBase` overlaps the host-to-device copy, `TrainPipelineSparseDist` adds input_dist
(all-to-all) ahead of forward, `PrefetchTrainPipelineSparseDist` adds a prefetch stage so forward
never waits on communication. Constructors and `progress()` follow torchrec's, so a torchrec user
switches by changing an import.
"""

from pipeline.base import TrainPipelineBase
from pipeline.context import BatchContext, PrefetchBatchContext
from pipeline.sparse_dist import PrefetchTrainPipelineSparseDist, TrainPipelineSparseDist
from pipeline.streams import CudaStreams, HandoffError, RecordingStreams, Streams

__all__ = [
    "BatchContext",
    "CudaStreams",
    "HandoffError",
    "PrefetchBatchContext",
    "PrefetchTrainPipelineSparseDist",
    "RecordingStreams",
    "Streams",
    "TrainPipelineBase",
    "TrainPipelineSparseDist",
]
