"""Moving a batch of any shape to the device.

A batch that implements torchrec's Pipelineable (`.to(device, non_blocking)`) moves itself; dicts,
lists, tuples and dataclasses are moved field by field, so a batch need not be a torchrec type.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["to_device"]


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
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
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
