"""Provenance: how each object seen during a recorded forward was derived from the batch.

Objects are known by identity. The batch and everything in it (KeyedJaggedTensors, tensors,
collections, dataclass fields) start with their paths; a pure operation (`rewrite.ops`) on a known
object gives its result a program. Anything else computed from a known object is *tainted*: it
carries the reason it cannot be replayed (the first operation that was not pure), and the user's
source line where known. Python numbers that forward read out of batch data (`.item()`, `.tolist()`,
`int(t)`, `kjt.stride()`) are remembered: a constant argument equal to one of them may be
data-dependent, so it is refused rather than baked into a program. Shapes and sizes are not
remembered (forward reads the batch size everywhere, and small segment counts would collide with
it): a constant taken from a shape is baked in, as the trace would not (a known gap).

Known objects are held (their ids must not be reused while recording); tainted tensors are held
weakly, so recording does not keep forward's intermediates alive.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from rewrite.arginfo import ArgInfo, Build, Call, CallArgs, Const, Item, Pack
from rewrite.direct import children
from rewrite.ops import METHODS
from rewrite.sites import user_source

__all__ = ["Provenance", "Untracked"]

_MAX_DEPTH = 8
_ATOMS = (type(None), bool, str, bytes, torch.device, torch.dtype)
_READS = {"item", "tolist", "__int__", "__index__", "__float__"}


class Untracked(Exception):
    """A value a program would need is not derived from the batch by pure steps."""

    def __init__(self, reason: str, source: str | None = None) -> None:
        super().__init__(reason)
        self.source = source


class Provenance:
    """What is known about the objects of one recorded forward.

    Args:
        batch: the batch forward receives.
        owned: names of the model's parameters and buffers by id (for reasons).
    """

    def __init__(self, batch: Any, owned: dict[int, str]) -> None:
        self._known: dict[int, tuple[Any, ArgInfo]] = {}
        self._tainted: dict[int, tuple[Any, str, str | None]] = {}
        self._scalars: dict[int | float, str] = {}
        self._owned = owned
        self._walk(batch, ArgInfo(), 0)

    def _walk(self, value: Any, info: ArgInfo, depth: int) -> None:
        if isinstance(value, (*_ATOMS, int, float)) or id(value) in self._known:
            return
        self._known[id(value)] = (value, info)
        if depth < _MAX_DEPTH and not isinstance(value, (torch.Tensor, KeyedJaggedTensor, JaggedTensor)):
            for step, child in children(value):
                self._walk(child, info.then(step), depth + 1)

    # -- queries --------------------------------------------------------------------------------

    def info(self, value: Any) -> ArgInfo | None:
        """The program of a known object (None if unknown or tainted)."""
        if self._taint(value) is not None:
            return None
        entry = self._known.get(id(value))
        return entry[1] if entry is not None else None

    def _taint(self, value: Any) -> tuple[str, str | None] | None:
        entry = self._tainted.get(id(value))
        if entry is None:
            return None
        held, reason, source = entry
        alive = held() if isinstance(held, weakref.ref) else held
        return (reason, source) if alive is value else None

    def arg_info(self, value: Any) -> ArgInfo:
        """The program that computes `value` from the batch.

        Raises:
            Untracked: `value` is not derived from the batch by pure steps (with the reason).
        """
        info = self.info(value)
        if info is not None:
            return info
        taint = self._taint(value)
        if taint is not None:
            raise Untracked(*taint)
        if isinstance(value, _ATOMS):
            return ArgInfo((Const(value),))
        if isinstance(value, (int, float)):
            self._check_scalar(value)
            return ArgInfo((Const(value),))
        if isinstance(value, (list, tuple, dict)):
            return self._pack(value)
        if isinstance(value, (torch.Tensor, KeyedJaggedTensor, JaggedTensor)):
            raise Untracked(self._unknown(value))
        raise Untracked(f"a {type(value).__name__} that is not part of the batch")

    def _pack(self, value: list | tuple | dict) -> ArgInfo:
        keys = list(value) if isinstance(value, dict) else []
        items = tuple(self.arg_info(v) for v in (value.values() if isinstance(value, dict) else value))
        if all(i.steps and isinstance(i.steps[0], Const) for i in items):
            return ArgInfo((Const(_copy(value)),))
        if isinstance(value, dict):
            return ArgInfo(source=Pack(dict, items, keys=tuple(keys)))
        kind = type(value) if isinstance(value, tuple) else list
        return ArgInfo(source=Pack(kind, items))

    def _unknown(self, value: Any) -> str:
        name = self._owned.get(id(value))
        if name is not None:
            return f"{name} of the model, not derived from the batch"
        return (
            f"a {type(value).__name__} that is neither in the batch nor made from it by pure steps "
            "(a forward output, a model attribute, or a value created in forward)"
        )

    def _check_scalar(self, value: int | float) -> None:
        if not isinstance(value, bool) and value in self._scalars:
            raise Untracked(
                f"the constant {value!r} may be data-dependent: forward read {value!r} from "
                f"{self._scalars[value]}; give an explicit input for this module"
            )

    # -- events ---------------------------------------------------------------------------------

    def method(self, receiver: Any, name: str, args: tuple, kwargs: dict, result: Any) -> None:
        """`receiver.name(*args, **kwargs)` returned `result` (a pure method)."""
        info = self.info(receiver)
        if info is None:
            taint = self._taint(receiver)
            if taint is not None:
                self._mark(result, *taint)
            return
        try:
            consts = [self._constant(a) for a in (*args, *kwargs.values())]
        except Untracked as e:
            self._mark(result, f"{info}.{name}() called with {e}", e.source)
            return
        if name == "__getitem__":
            if not isinstance(consts[0], (str, int)):
                self._mark(
                    result, f"{info} indexed by {consts[0]!r} (only a key or an index is replayed)", None
                )
                return
            step: Item | Call = Item(consts[0])
        else:
            step = Call(
                name, tuple(consts[: len(args)]), tuple(zip(kwargs, consts[len(args) :], strict=True))
            )
        self._result(result, info.then(step))

    def build(self, name: str, result: Any, args: tuple, kwargs: dict, source: str | None) -> None:
        """Constructor `name` (a `rewrite.ops.CONSTRUCTORS` key) returned `result`."""
        try:
            call = CallArgs(
                args=tuple(self.arg_info(a) for a in args),
                kwargs={k: self.arg_info(v) for k, v in kwargs.items()},
            )
        except Untracked as e:
            self._mark(result, f"{name}(...) built from {e}", e.source or source)
            return
        self._result(result, ArgInfo(source=Build(name, call)))

    def torch_op(self, func: Any, args: tuple, kwargs: dict, result: Any) -> None:
        """A torch function or tensor method ran on `args`; `result` is what it returned."""
        inputs = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
        taints = [t for t in map(self._taint, inputs) if t is not None]
        known = [i for i in map(self.info, inputs) if i is not None]
        if not (taints or known):
            return
        name = getattr(func, "__name__", str(func))
        receiver = self.info(args[0]) if args and isinstance(args[0], torch.Tensor) else None
        if name in _READS:
            self._read(result, f"{known[0]}.{name}()" if known and not taints else taints[0][0])
        elif isinstance(result, (int, float, torch.Size)):
            return  # shapes and sizes: not tracked (see the module's docstring)
        elif (name.endswith("_") and not name.startswith("_")) or name == "__setitem__":
            self._mark(args[0], f"modified in place by .{name}() inside forward", None)
        elif (
            receiver is not None
            and not taints
            and (name == "__getitem__" or torch.Tensor in METHODS.get(name, ()))
        ):
            self.method(args[0], name, args[1:], kwargs, result)
        else:
            reason, source = (
                taints[0] if taints else (f"a value computed from {known[0]} by {name}", user_source())
            )
            for out in pytree.tree_leaves(result):
                if isinstance(out, torch.Tensor):
                    self._mark(out, reason, source)

    # -- bookkeeping ----------------------------------------------------------------------------

    def _constant(self, value: Any) -> Any:
        """`value` as a constant argument of a method: no batch-derived value inside.

        Raises:
            Untracked: it holds a tensor or another computed value (or a data-dependent number).
        """
        info = self.arg_info(value)
        if not (info.steps and isinstance(info.steps[0], Const)):
            raise Untracked(f"the argument {info}, which is not a constant")
        return info.steps[0].value

    def _result(self, value: Any, info: ArgInfo) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            self._scalars.setdefault(value, str(info))
            return
        if isinstance(value, _ATOMS) or id(value) in self._known:
            return
        self._known[id(value)] = (value, info)
        if isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                self._result(item, info.then(Item(i)))
        elif isinstance(value, dict):
            for key, item in value.items():
                self._result(item, info.then(Item(key)))

    def _read(self, value: Any, how: str) -> None:
        for leaf in pytree.tree_leaves(list(value) if isinstance(value, torch.Size) else value):
            if isinstance(leaf, (int, float)) and not isinstance(leaf, bool):
                self._scalars.setdefault(leaf, how)

    def _mark(self, value: Any, reason: str, source: str | None) -> None:
        if isinstance(value, (*_ATOMS, int, float)):  # interned: not known by identity
            self._read(value, reason)
            return
        try:
            held: Any = weakref.ref(value)
        except TypeError:  # lists, dicts: held strongly, they are small
            held = value
        self._tainted[id(value)] = (held, reason, source)


def _copy(value: Any) -> Any:
    """A copy of a constant collection (forward may change its own list later)."""
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    if type(value) is tuple:
        return tuple(_copy(v) for v in value)
    return value
