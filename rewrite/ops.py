"""The pure operations a program over the batch may replay, and the fx patch that traces them.

A program (`rewrite.arginfo.ArgInfo`) replays, on the data path, only operations that read nothing but
their receiver and constant arguments, and write nothing the model reads:

- methods of a KeyedJaggedTensor: `split`, `permute`, `to_dict`, `keys`, `values`, `lengths`,
  `offsets`, `weights`, `weights_or_none`, `lengths_or_none`, `offsets_or_none`, `stride`,
  `length_per_key`, `offset_per_key`, `sync`, `unsync` (and `kjt[key]`, an item step);
- methods of a JaggedTensor: `values`, `lengths`, `offsets`, `weights`, `weights_or_none`,
  `lengths_or_none`, `offsets_or_none`;
- methods of a tensor that change only its dtype or shape: `long`, `int`, `view`, `reshape`,
  `flatten`, `contiguous`;
- constructors (`CONSTRUCTORS`): `KeyedJaggedTensor(...)`, `KeyedJaggedTensor.from_lengths_sync`,
  `.from_offsets_sync`, `.from_jt_dict`, `JaggedTensor(...)`, `JaggedTensor.from_dense_lengths`.

Anything else (tensor arithmetic, reductions such as `values().max()`, indexing by computed values)
is not replayed: a module whose input needs it stays unpipelined. KeyedJaggedTensor methods cache
what they compute on the object (offsets, lengths, `to_dict`'s JaggedTensors); replay calls them on
a shallow copy (`own_receiver`), so it never writes into the batch's objects, which forward reads on
another stream.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import fx
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

__all__ = [
    "CONSTRUCTORS",
    "METHODS",
    "constructor_name",
    "own_receiver",
    "static_constructors",
    "traceable_constructors",
]

_KJT_METHODS = (
    "split permute to_dict keys values lengths offsets weights weights_or_none lengths_or_none "
    "offsets_or_none stride length_per_key offset_per_key sync unsync"
).split()
_JT_METHODS = "values lengths offsets weights weights_or_none lengths_or_none offsets_or_none".split()
_TENSOR_METHODS = "long int view reshape flatten contiguous".split()


def _receivers() -> dict[str, tuple[type, ...]]:
    found: dict[str, tuple[type, ...]] = {}
    for cls, names in (
        (KeyedJaggedTensor, _KJT_METHODS),
        (JaggedTensor, _JT_METHODS),
        (torch.Tensor, _TENSOR_METHODS),
    ):
        for name in names:
            found[name] = (*found.get(name, ()), cls)
    return found


METHODS: dict[str, tuple[type, ...]] = _receivers()
"""The pure methods a program may call, with the types each may be called on."""

_STATIC = (
    (KeyedJaggedTensor, "from_lengths_sync"),
    (KeyedJaggedTensor, "from_offsets_sync"),
    (KeyedJaggedTensor, "from_jt_dict"),
    (JaggedTensor, "from_dense_lengths"),
)

CONSTRUCTORS: dict[str, Callable[..., Any]] = {
    "KeyedJaggedTensor": KeyedJaggedTensor,
    "JaggedTensor": JaggedTensor,
    **{f"{cls.__name__}.{name}": vars(cls)[name].__func__ for cls, name in _STATIC},
}
"""The constructions a program may replay, by the name it prints (the originals, captured at import,
before any patch)."""

_NAMES = {id(fn): name for name, fn in CONSTRUCTORS.items()}


def constructor_name(target: object) -> str | None:
    """The `CONSTRUCTORS` name of `target` (a class or an original static method), or None."""
    name = _NAMES.get(id(target))
    return name if name is not None and CONSTRUCTORS[name] is target else None


def static_constructors() -> tuple[tuple[type, str], ...]:
    """The `(class, name)` of each static constructor (patched while tracing and recording)."""
    return _STATIC


def own_receiver(value: Any) -> Any:
    """`value`, or a shallow copy of it when a method would cache what it computes on it."""
    if isinstance(value, (KeyedJaggedTensor, JaggedTensor)):
        return copy.copy(value)
    return value


def _first_proxy(args: Any, kwargs: Any) -> fx.Proxy | None:
    found: list[fx.Proxy] = []
    for value in (args, kwargs):
        fx.node.map_aggregate(value, lambda a: found.append(a) if isinstance(a, fx.Proxy) else None)
    return found[0] if found else None


def _traced(original: Callable[..., Any]) -> Callable[..., Any]:
    def construct(*args: Any, **kwargs: Any) -> Any:
        proxy = _first_proxy(args, kwargs)
        if proxy is None:
            return original(*args, **kwargs)
        return proxy.tracer.create_proxy("call_function", original, args, kwargs)

    return construct


@contextmanager
def traceable_constructors() -> Iterator[None]:
    """While fx traces: a static constructor called with a Proxy records one call_function node
    whose target is the original function (its body would trace into torch ops, or fail on
    `len(proxy)`). The classes' own constructors record theirs already: torchrec's metaclass is
    fx's ProxyableClassMeta. Every patch is undone on exit, also when the trace raises."""
    saved: list[tuple[type, str, Any]] = []
    try:
        for cls, name in _STATIC:
            original = vars(cls)[name]
            saved.append((cls, name, original))
            setattr(cls, name, staticmethod(_traced(original.__func__)))
        yield
    finally:
        for cls, name, original in reversed(saved):
            setattr(cls, name, original)
