"""Call sites: each call of a sharded module in one forward, and how its input is found.

A sharded module called k times in one forward has k call sites, in call order. `SiteInput` is what
a finding method (explicit, traced, direct, recorded) says about one site: the program that computes
its arguments from the batch, or why there is none; `CallSite` is a pipelined one, and
`PipelinedModule` a hijacked module with its sites. `ExplicitInput` replays a user's function, and
`difference` compares a replayed input with what forward really passed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torchrec
from torch import nn
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from rewrite.arginfo import CallArgs, PathError, PostprocCall

__all__ = [
    "CallSite",
    "ExplicitInput",
    "PipelinedModule",
    "SiteInput",
    "difference",
    "explicit_entries",
    "model_frame",
    "show_source",
    "user_source",
]


@dataclass(frozen=True, slots=True)
class ExplicitInput:
    """Call site `index` of a user's function `batch -> [entry per call site]` (see
    `explicit_entries`); the function runs once per batch when replay passes a cache."""

    fn: Callable[[Any], Any]
    index: int
    fqn: str

    @property
    def is_path(self) -> bool:
        return False

    def build(self, batch: Any, postproc: Any = None, cache: dict | None = None) -> tuple[list, dict]:
        """The call's `(args, kwargs)` for `batch`."""
        if cache is None:
            entries = explicit_entries(self.fqn, self.fn(batch))
        else:
            hit = cache.get(id(self.fn))
            if hit is None:
                hit = cache[id(self.fn)] = (self.fn, explicit_entries(self.fqn, self.fn(batch)))
            entries = hit[1]
        if self.index >= len(entries):
            raise PathError(
                f"the explicit input of {self.fqn!r} returned {len(entries)} entries for this batch; "
                f"call site {self.index} has none (one entry per call of the module in forward)"
            )
        args, kwargs = entries[self.index]
        return list(args), dict(kwargs)

    def postprocs(self) -> list[PostprocCall]:
        return []

    def __str__(self) -> str:
        name = getattr(self.fn, "__name__", type(self.fn).__name__)
        return f"{name}(batch)[{self.index}]"


def explicit_entries(fqn: str, value: Any) -> list[tuple[tuple, dict]]:
    """A user function's result as `(args, kwargs)` per call site.

    The function returns a list with one entry per call of the module in forward, each a
    KeyedJaggedTensor (the call's one argument) or an `(args, kwargs)` pair (a tuple or list, and
    a dict); a single KeyedJaggedTensor stands for a list of one.

    Raises:
        PathError: any other shape.
    """
    if isinstance(value, KeyedJaggedTensor):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise PathError(
            f"the explicit input of {fqn!r} returned a {type(value).__name__}; return a list with one "
            "entry per call of the module in forward: a KeyedJaggedTensor or an (args, kwargs) pair"
        )
    entries = []
    for i, entry in enumerate(value):
        if isinstance(entry, KeyedJaggedTensor):
            entries.append(((entry,), {}))
        elif (
            isinstance(entry, tuple)
            and len(entry) == 2
            and isinstance(entry[0], (list, tuple))
            and isinstance(entry[1], dict)
        ):
            entries.append((tuple(entry[0]), entry[1]))
        else:
            raise PathError(
                f"the explicit input of {fqn!r}, entry {i}, is a {type(entry).__name__}: each entry "
                "is a KeyedJaggedTensor or an (args, kwargs) pair"
            )
    return entries


@dataclass(frozen=True, slots=True)
class SiteInput:
    """What a finding method says about one call site."""

    args: CallArgs | ExplicitInput | None = None
    """How the call's arguments are computed from the batch; None when they cannot be."""
    reason: str | None = None
    """Why not, when `args` is None."""
    source: str | None = None
    """The user's source line (`file:line`) of the call, or of the step that was rejected."""


def difference(expected: Any, got: Any, where: str = "argument") -> str | None:
    """How `got` (what forward passed) differs from `expected` (the replayed input), or None when
    equal: keys, lengths, values and weights of KeyedJaggedTensors and JaggedTensors, tensors
    element by element, collections item by item, anything else by `==`."""
    if isinstance(expected, KeyedJaggedTensor) or isinstance(got, KeyedJaggedTensor):
        if not (isinstance(expected, KeyedJaggedTensor) and isinstance(got, KeyedJaggedTensor)):
            return f"{where}: {type(got).__name__} passed, {type(expected).__name__} replayed"
        if expected.keys() != got.keys():
            return f"{where}: keys {got.keys()} passed, {expected.keys()} replayed"
        return _jagged(expected, got, where)
    if isinstance(expected, JaggedTensor) or isinstance(got, JaggedTensor):
        if not (isinstance(expected, JaggedTensor) and isinstance(got, JaggedTensor)):
            return f"{where}: {type(got).__name__} passed, {type(expected).__name__} replayed"
        return _jagged(expected, got, where)
    if isinstance(expected, torch.Tensor) or isinstance(got, torch.Tensor):
        return None if _equal(expected, got) else f"{where}: tensor values differ"
    if isinstance(expected, dict) and isinstance(got, dict):
        if set(expected) != set(got):
            return f"{where}: dict keys {sorted(got)} passed, {sorted(expected)} replayed"
        return _first(difference(expected[k], got[k], f"{where}[{k!r}]") for k in expected)
    if isinstance(expected, (list, tuple)) and isinstance(got, (list, tuple)):
        if len(expected) != len(got):
            return f"{where}: {len(got)} items passed, {len(expected)} replayed"
        return _first(
            difference(e, g, f"{where}[{i}]") for i, (e, g) in enumerate(zip(expected, got, strict=True))
        )
    try:
        same = bool(expected == got)
    except Exception:  # an object whose == is not a truth value
        same = expected is got
    return None if same else f"{where}: {got!r} passed, {expected!r} replayed"


def _jagged(expected: Any, got: Any, where: str) -> str | None:
    for name in ("lengths", "values", "weights_or_none"):
        e, g = getattr(expected, name)(), getattr(got, name)()
        if not _equal(e, g):
            return f"{where}: {name.removesuffix('_or_none')} differ ({_first_change(e, g)})"
    return None


def _first_change(expected: Any, got: Any) -> str:
    if expected is None or got is None:
        return (
            f"{'none' if got is None else 'some'} passed, {'none' if expected is None else 'some'} replayed"
        )
    if expected.shape != got.shape:
        return f"shape {tuple(got.shape)} passed, {tuple(expected.shape)} replayed"
    i = int((expected.flatten() != got.flatten()).nonzero()[0])
    return f"at {i}: {got.flatten()[i].item()} passed, {expected.flatten()[i].item()} replayed"


def _equal(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def _first(found: Any) -> str | None:
    return next((d for d in found if d is not None), None)


_TORCH, _TORCHREC, _REWRITE = (
    os.path.dirname(os.path.abspath(path)) + os.sep for path in (torch.__file__, torchrec.__file__, __file__)
)
_LIBRARIES = (_TORCH, _TORCHREC, _REWRITE)
"""Source folders of torch, torchrec and rewrite/: frames there are not the user's."""
_CALLER = os.path.join(os.path.dirname(_REWRITE.rstrip(os.sep)), "pipeline") + os.sep
"""The pipeline package beside rewrite/: it calls the model, so a walk out of the model stops there."""


def model_frame(frame: FrameType | None) -> FrameType | None:
    """The innermost frame of the model's code from `frame` outwards: the user's, or where the model is
    torchrec's own (its DLRM), torchrec's; None where the walk reaches the pipeline that called the
    model first (the line would be the pipeline's, not the model's)."""
    fallback = None
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path.startswith(_CALLER):
            return fallback
        if not path.startswith(_LIBRARIES):
            return frame
        if fallback is None and path.startswith(_TORCHREC):
            fallback = frame
        frame = frame.f_back
    return fallback


def show_source(path: str, line: int | str) -> str:
    """`file:line`, relative to the working directory when inside it."""
    rel = os.path.relpath(path)
    return f"{path if rel.startswith('..') else rel}:{line}"


def user_source() -> str | None:
    """`file:line` of the model's code on the current stack (`model_frame`), or None."""
    frame = model_frame(sys._getframe(1))
    return None if frame is None else show_source(frame.f_code.co_filename, frame.f_lineno)


@dataclass(frozen=True, slots=True)
class CallSite:
    """One call of a pipelined sharded module in forward, and how its input comes from the batch."""

    key: str
    """`site_key(fqn, index)`: what the pipeline keys this call's module context and input_dist by."""
    fqn: str
    index: int
    """Its place among the module's calls in one forward, from 0."""
    module: nn.Module
    args: CallArgs | ExplicitInput
    """`args.build(batch, postproc, cache) -> (args, kwargs)`: its arguments for a batch."""


@dataclass(kw_only=True, slots=True)
class PipelinedModule:
    """A sharded module whose forward was hijacked, and its call sites."""

    fqn: str
    module: nn.Module
    args: CallArgs | ExplicitInput
    """Its first call site's program (key `fqn`): all a module called once needs."""
    sites: tuple[CallSite, ...] = ()
