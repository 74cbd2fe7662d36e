"""`CudaStreams`: the streams of a CUDA device (side streams for the copy, the input all-to-all and
the prefetch), with the hand-off of `pipeline.stages.streams.OrderedStreams`, and `record_stream`
where it remains (see `pipeline.stages.streams`).
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from typing import Any

import torch

from pipeline.stages.streams import OrderedStreams

__all__ = ["CudaStreams"]


class CudaStreams(OrderedStreams):
    """Side streams on a CUDA device; copy and communication at high priority.

    Args:
        device: the CUDA device.
        prefetch: make a prefetch stream.
        data_dist: make a data_dist stream; without, input_dist runs on the caller's stream (no
            memory pool of another stream).
        handoff: one of `HANDOFFS` ("record-stream" is there to compare the two in-flight memories).
    """

    def __init__(
        self,
        device: torch.device,
        *,
        prefetch: bool = True,
        data_dist: bool = True,
        handoff: str = "keep-alive",
    ) -> None:
        super().__init__(torch.cuda.Event, handoff=handoff)
        high = torch.cuda.Stream.priority_range()[1]  # lowest number is the highest priority
        self.device = device
        self.memcpy = torch.cuda.Stream(device=device, priority=high)
        # without: input_dist runs on the caller's stream (no memory pool of another stream)
        self.data_dist = torch.cuda.Stream(device=device, priority=high) if data_dist else None
        self.prefetch = torch.cuda.Stream(device=device) if prefetch else None

    def current(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def use(self, stream: Any):
        return torch.cuda.stream(stream) if stream is not None else nullcontext()

    def record(self, obj: Any, stream: Any) -> None:
        _record_stream(obj, stream)

    def free_after(self, tensor: Any, stream: Any) -> None:
        _record_stream(tensor, stream)


def _record_stream(obj: Any, stream: Any) -> None:
    if isinstance(obj, torch.Tensor):
        if obj.is_cuda:
            obj.record_stream(stream)
    elif hasattr(obj, "record_stream"):
        obj.record_stream(stream)
    elif isinstance(obj, dict):
        for v in obj.values():
            _record_stream(v, stream)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _record_stream(v, stream)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _record_stream(getattr(obj, f.name), stream)
