"""The copy stage: moving a batch of any shape to the device.

A batch that implements torchrec's Pipelineable (`.to(device, non_blocking)`) moves itself; dicts,
lists, tuples, namedtuples and dataclasses are moved field by field, so a batch need not be a
torchrec type.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["to_device", "to_device_in_place"]


def to_device(batch: Any, device: torch.device, non_blocking: bool) -> Any:
    """`batch` with every tensor (and every object with `.to`) on `device`."""
    if isinstance(batch, torch.Tensor) or (
        hasattr(batch, "to")
        and not isinstance(batch, (dict, list, tuple, type))
        and not dataclasses.is_dataclass(batch)
    ):
        return batch.to(device=device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return type(batch)((k, to_device(v, device, non_blocking)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple takes its fields apart
        return type(batch)(*(to_device(v, device, non_blocking) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device, non_blocking) for v in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        if hasattr(batch, "to"):  # a Pipelineable dataclass, e.g. torchrec's Batch
            return batch.to(device=device, non_blocking=non_blocking)
        changes = {
            f.name: to_device(getattr(batch, f.name), device, non_blocking)
            for f in dataclasses.fields(batch)
            if f.init
        }
        return dataclasses.replace(batch, **changes)
    return batch


def to_device_in_place(batch: Any, device: torch.device, streams: Any) -> Any:
    """`batch` on `device`, its tensors allocated on the current stream and filled on the memcpy
    stream (torchrec's `enable_inplace_copy_batch`), so their memory belongs to the stream that
    uses them. Objects with their own `.to` (a KeyedJaggedTensor) are copied on memcpy as usual.
    Without a memcpy stream (CPU) this is `to_device`."""
    memcpy = streams.memcpy
    if memcpy is None:
        return to_device(batch, device, non_blocking=True)
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    out = _allocate(batch, device, streams, copies)
    current, fill = streams.current(), object()
    with streams.use(memcpy):
        # The new blocks may be memory the current stream still reads: the fill waits for it. And
        # the copies write memory the current stream owns: it is held until they are done, in
        # case the batch is dropped before the current stream waits for them.
        streams.handoff(out, current, fill)
        for dst, src in copies:
            dst.copy_(src, non_blocking=True)
    streams.release(fill)  # the copies are memcpy's last use
    return out


def _allocate(batch: Any, device: torch.device, streams: Any, copies: list) -> Any:
    """`batch` with each tensor replaced by an empty one on `device` (on the current stream), the
    pairs to copy appended to `copies`; objects with their own `.to` are moved on memcpy."""
    if isinstance(batch, torch.Tensor):
        out = torch.empty_like(batch, device=device)
        copies.append((out, batch))
        return out
    if isinstance(batch, dict):
        return type(batch)((k, _allocate(v, device, streams, copies)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_allocate(v, device, streams, copies) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_allocate(v, device, streams, copies) for v in batch)
    with streams.use(streams.memcpy):
        return to_device(batch, device, non_blocking=True)
