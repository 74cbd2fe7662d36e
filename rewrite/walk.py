"""Walk an fx graph back from a sharded module's call to the batch, building its program.

Each node on the way becomes a step: getattr / getitem with a constant key (`Attr`, `Item`), a pure
method with constant arguments (`Call`), a KeyedJaggedTensor or JaggedTensor construction (`Build`),
a list / tuple / dict / namedtuple of values (`Pack`), or a parameter-free module (`PostprocCall`).
One program object per node, so call sites that read the same value share it (and replay computes
it once per batch). Anything else rejects the call site with the reason and the user's source line.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from torch import fx, nn

from rewrite.arginfo import ArgInfo, Attr, Build, Call, CallArgs, Const, Item, Pack, PostprocCall
from rewrite.ops import METHODS, constructor_name
from rewrite.sites import SiteInput, show_source

__all__ = ["Walker", "source_line"]


class _Reject(Exception):
    def __init__(self, reason: str, node: fx.Node | None = None) -> None:
        super().__init__(reason)
        self.node = node


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')


def source_line(node: fx.Node | None) -> str | None:
    """`file:line` of the user's code that created `node` (traced with stack traces), or None."""
    found = _FRAME.findall((node.stack_trace or "") if node is not None else "")
    if not found:
        return None
    path, line = found[-1]
    return show_source(path, line)


@dataclass(slots=True)
class Walker:
    """Programs for the call sites of one traced graph."""

    batch: fx.Node | None
    """The placeholder of the batch (forward's first argument)."""
    modules: dict[str, nn.Module]
    calls: Counter[str]
    """How many times the traced forward calls each leaf module."""
    pipeline_postproc: bool
    memo: dict[fx.Node, ArgInfo | _Reject] = field(default_factory=dict)
    """The program of each node walked, or why it has none."""

    def site(self, node: fx.Node) -> SiteInput:
        """The call site `node` (a call_module of a sharded module)."""
        try:
            return SiteInput(args=self.call_args(node), source=source_line(node))
        except _Reject as e:
            return SiteInput(reason=str(e), source=source_line(e.node or node))

    def call_args(self, node: fx.Node) -> CallArgs:
        return CallArgs(
            args=self.items(node.args),
            kwargs={k: self.arg_info(v) for k, v in node.kwargs.items()},
        )

    def items(self, values: Iterable[object]) -> tuple[ArgInfo, ...]:
        return tuple(self.arg_info(v) for v in values)

    def arg_info(self, value: object) -> ArgInfo:
        if isinstance(value, fx.Node):
            if value not in self.memo:
                try:
                    self.memo[value] = self._node(value)
                except _Reject as e:
                    self.memo[value] = e
            found = self.memo[value]
            if isinstance(found, _Reject):
                raise found
            return found
        if not _holds_node(value):
            return ArgInfo((Const(_plain(value)),))
        if isinstance(value, dict):
            return ArgInfo(source=Pack(dict, self.items(value.values()), keys=tuple(value)))
        if isinstance(value, (list, tuple)):
            return ArgInfo(source=Pack(type(value) if isinstance(value, tuple) else list, self.items(value)))
        raise _Reject(
            f"input passes a {type(value).__name__} built from batch values; only lists, tuples and "
            "dicts of batch values can be rebuilt ahead"
        )

    def _node(self, node: fx.Node) -> ArgInfo:
        if node.op == "placeholder":
            if node is not self.batch:
                raise _Reject(f"input comes from forward argument {node.name!r}, not the batch", node)
            return ArgInfo()
        if node.op == "call_function" and node.target in (getattr, operator.getitem):
            key = node.args[1]
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise _Reject(f"input indexed by a computed key ({node.format_node()})", node)
            return self.arg_info(node.args[0]).then(Attr(key) if node.target is getattr else Item(key))
        if node.op == "call_method":
            return self._method(node)
        if node.op == "call_module":
            return ArgInfo(source=self._postproc(node))
        if node.op == "call_function":
            name = constructor_name(node.target)
            if name is not None:
                return ArgInfo(source=Build(name, self.call_args(node)))
            if _is_namedtuple(node.target) and not node.kwargs:
                # fx records a namedtuple argument as a call of its class on the fields
                return ArgInfo(source=Pack(node.target, self.items(node.args)))
        root = self._first_impure(node)
        raise _Reject(_why_not(root), root)

    def _first_impure(self, node: fx.Node) -> fx.Node:
        """The operation closest to the batch, upstream of `node`, that cannot be replayed (for a
        reason that names `values().max()` rather than the arithmetic that uses it)."""
        for parent in node.all_input_nodes:
            try:
                self.arg_info(parent)
            except _Reject as e:
                return e.node if e.node is not None else parent
        return node

    def _method(self, node: fx.Node) -> ArgInfo:
        if node.target not in METHODS:
            root = self._first_impure(node)
            raise _Reject(_why_not(root), root)
        name = node.target
        args, kwargs = node.args[1:], node.kwargs
        if _holds_node(args) or _holds_node(kwargs):
            raise _Reject(
                f"input is computed by .{name}() with an argument computed inside forward "
                f"({node.format_node()}); only constant arguments are replayed ahead",
                node,
            )
        step = Call(name, _plain(tuple(args)), tuple(_plain(dict(kwargs)).items()))
        return self.arg_info(node.args[0]).then(step)

    def _postproc(self, node: fx.Node) -> PostprocCall:
        module = self.modules[node.target]
        if any(p.requires_grad for p in module.parameters()):
            raise _Reject(
                f"input is computed by module {node.target!r}, which has trainable parameters; "
                "it must run in forward, so its output cannot be distributed ahead",
                node,
            )
        if not self.pipeline_postproc:
            raise _Reject(
                f"input is computed by parameter-free module {node.target!r} (a postproc); "
                "pass pipeline_postproc=True to run it ahead with input_dist",
                node,
            )
        if self.calls[node.target] > 1:
            raise _Reject(
                f"input is computed by postproc module {node.target!r}, which forward calls "
                f"{self.calls[node.target]} times; its output is computed once per batch ahead, so "
                "every call would return the same value",
                node,
            )
        return PostprocCall(node.target, self.call_args(node))


def _is_namedtuple(target: object) -> bool:
    return isinstance(target, type) and issubclass(target, tuple) and hasattr(target, "_fields")


def _holds_node(value: object) -> bool:
    """Whether a value fx keeps in a node's arguments (a collection, a slice, a range) holds a node."""
    found: list[fx.Node] = []
    fx.node.map_arg(value, found.append)
    return bool(found)


def _plain(value: Any) -> Any:
    """fx's immutable lists and dicts as plain ones (what forward passed), recursively."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if type(value) is tuple:
        return tuple(_plain(v) for v in value)
    return value


def _why_not(node: fx.Node) -> str:
    if node.op == "get_attr":
        return f"input is the model attribute {node.target!r}, not derived from the batch"
    if node.op == "call_function" and dataclasses.is_dataclass(node.target):
        return (
            f"input is a {node.target.__name__} dataclass built inside forward ({node.format_node()}); "
            "only lists, tuples and dicts of batch values can be rebuilt ahead"
        )
    what = getattr(node.target, "__name__", node.target)
    return (
        f"input is computed by {node.op} {what!r} inside forward ({node.format_node()}), which is "
        "not a pure step: only attribute/item access, pure KeyedJaggedTensor / JaggedTensor "
        "methods and constructions (rewrite.ops), or a parameter-free module, are run ahead; a "
        "value computed from the batch's data (such as values().max()) is not"
    )
