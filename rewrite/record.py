"""Recording: find each sharded module call's input by watching one real forward.

Where the fx trace fails (data-dependent control flow, say), `record_calls` is wrapped around one
real forward of the model on a batch. For its duration, on the calling thread only:

- the pure KeyedJaggedTensor / JaggedTensor methods and constructors (`rewrite.ops`) are wrapped so
  that each result gets a program from its receiver's and arguments' programs
  (`rewrite.provenance`); a torch function mode does the same for the pure tensor methods, and
  marks everything else computed from batch values as not replayable, with the reason;
- every outermost sharded module gets a forward pre-hook that reads the program of each argument it
  receives (one `ObservedCall` per call, in call order); inside a sharded module nothing is watched.

On exit, also when forward raises, every wrapper, hook and mode is removed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.overrides import TorchFunctionMode
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from rewrite.arginfo import CallArgs
from rewrite.ops import METHODS, static_constructors
from rewrite.provenance import Provenance, Untracked
from rewrite.sites import SiteInput, user_source

__all__ = ["ObservedCall", "Recording", "record_calls"]


@dataclass(slots=True)
class ObservedCall:
    """One call of a sharded module in the recorded forward."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    """What forward passed."""
    input: SiteInput
    """Its program, or why there is none."""


@dataclass(slots=True)
class Recording:
    """What `record_calls` saw: per sharded module FQN, its calls in order."""

    calls: dict[str, list[ObservedCall]] = field(default_factory=dict)


class _Watch:
    """Events are recorded on one thread, outside sharded modules and outside recorded calls."""

    __slots__ = ("depth", "thread")

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.depth = 0

    def watching(self) -> bool:
        return self.depth == 0 and threading.get_ident() == self.thread

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` with nothing inside it watched."""
        self.depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            self.depth -= 1


class _Mode(TorchFunctionMode):
    def __init__(self, prov: Provenance, watch: _Watch) -> None:
        super().__init__()
        self._prov, self._watch = prov, watch

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not self._watch.watching():
            return func(*args, **kwargs)
        result = self._watch.run(func, *args, **kwargs)
        self._prov.torch_op(func, args, kwargs, result)
        return result


@contextmanager
def record_calls(root: nn.Module, batch: Any, sharded: dict[str, nn.Module]) -> Iterator[Recording]:
    """Record, around one forward of `root` on `batch`, what each sharded module call receives.

    Args:
        root: the unwrapped model (for the names of its parameters and buffers in reasons).
        batch: the batch the forward inside the block receives.
        sharded: the outermost sharded modules by FQN.

    Yields:
        The Recording, filled while the block runs.
    """
    owned = {id(p): f"parameter {n!r}" for n, p in root.named_parameters()}
    owned.update({id(b): f"buffer {n!r}" for n, b in root.named_buffers()})
    prov, watch = Provenance(batch, owned), _Watch()
    recording = Recording({fqn: [] for fqn in sharded})
    undo: list[Callable[[], None]] = []
    try:
        undo += _wrap_operations(prov, watch)
        for fqn, module in sharded.items():
            undo += _hook(fqn, module, prov, watch, recording)
        with _Mode(prov, watch):
            yield recording
    finally:
        for step in reversed(undo):
            step()


def _wrap_operations(prov: Provenance, watch: _Watch) -> list[Callable[[], None]]:
    undo: list[Callable[[], None]] = []

    def replace(cls: type, name: str, new: Any) -> None:
        original = vars(cls)[name]
        setattr(cls, name, new)
        undo.append(lambda: setattr(cls, name, original))

    for cls in (KeyedJaggedTensor, JaggedTensor):
        for name in [n for n, kinds in METHODS.items() if cls in kinds] + ["__getitem__"]:
            if name in vars(cls):
                replace(cls, name, _method(vars(cls)[name], name, prov, watch))
        replace(cls, "__init__", _init(cls, vars(cls)["__init__"], prov, watch))
    for cls, name in static_constructors():
        replace(
            cls, name, staticmethod(_static(f"{cls.__name__}.{name}", vars(cls)[name].__func__, prov, watch))
        )
    return undo


def _method(original: Callable[..., Any], name: str, prov: Provenance, watch: _Watch) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not watch.watching():
            return original(self, *args, **kwargs)
        result = watch.run(original, self, *args, **kwargs)
        prov.method(self, name, args, kwargs, result)
        return result

    return method


def _init(cls: type, original: Callable[..., Any], prov: Provenance, watch: _Watch) -> Callable[..., None]:
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        if not watch.watching():
            return original(self, *args, **kwargs)
        watch.run(original, self, *args, **kwargs)
        if type(self) is cls:  # a subclass would be replayed as this class
            prov.build(cls.__name__, self, args, kwargs, user_source())
        return None

    return init


def _static(name: str, original: Callable[..., Any], prov: Provenance, watch: _Watch) -> Callable[..., Any]:
    def construct(*args: Any, **kwargs: Any) -> Any:
        if not watch.watching():
            return original(*args, **kwargs)
        result = watch.run(original, *args, **kwargs)
        prov.build(name, result, args, kwargs, user_source())
        return result

    return construct


def _hook(
    fqn: str, module: nn.Module, prov: Provenance, watch: _Watch, recording: Recording
) -> list[Callable[[], None]]:
    entered: list[bool] = []

    def before(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        entered.append(watch.watching())
        if not entered[-1]:
            return
        source = user_source()
        try:
            call = CallArgs(
                args=tuple(prov.arg_info(a) for a in args),
                kwargs={k: prov.arg_info(v) for k, v in kwargs.items()},
            )
            site = SiteInput(args=call, source=source)
        except Untracked as e:
            site = SiteInput(reason=f"its input is {e}", source=e.source or source)
        recording.calls[fqn].append(ObservedCall(args, dict(kwargs), site))
        watch.depth += 1  # nothing inside a sharded module is watched

    def after(mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if entered.pop():
            watch.depth -= 1

    handles = [
        module.register_forward_pre_hook(before, with_kwargs=True),
        module.register_forward_hook(after, with_kwargs=True, always_call=True),
    ]
    return [h.remove for h in handles]
