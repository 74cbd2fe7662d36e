"""The tensors inside an object a pipeline hands between streams, found by walking it: for
`RecordingStreams`, which maps each storage to the objects that hold it.

A batch, a KeyedJaggedTensor, torchrec's module contexts and awaitables are walked through their
containers, dataclass fields and attributes, to a small depth. Modules, parameters and callables
are not: a use of a model's weights is no use of what was handed over.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["storage_address", "storages_of"]

_DEPTH = 6
_SCALARS = (str, bytes, int, float, bool, complex, type, torch.dtype, torch.device, torch.Size)


def storages_of(obj: Any) -> list[tuple[int, torch.Tensor]]:
    """(storage address, tensor) of every tensor with storage found in `obj`."""
    found: list[tuple[int, torch.Tensor]] = []
    _walk(obj, found, set(), 0)
    return found


def _walk(obj: Any, found: list, seen: set[int], depth: int) -> None:
    if obj is None or depth > _DEPTH or id(obj) in seen or isinstance(obj, _SCALARS):
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        address = storage_address(obj)
        if address and not isinstance(obj, nn.Parameter):
            found.append((address, obj))
        return
    if isinstance(obj, nn.Module) or callable(obj):
        return
    if isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children = list(obj)
    else:
        children = list(getattr(obj, "__dict__", {}).values())
        for cls in type(obj).__mro__:
            for name in getattr(cls, "__slots__", ()):
                if isinstance(name, str) and hasattr(obj, name):
                    children.append(getattr(obj, name))
    for child in children:
        _walk(child, found, seen, depth + 1)


def storage_address(tensor: torch.Tensor) -> int:
    """The address of `tensor`'s storage; 0 for an empty one, or a tensor without storage."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage
        return 0
