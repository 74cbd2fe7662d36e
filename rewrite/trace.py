"""Find ArgInfos by torch.fx symbolic trace of the model's forward.

Sharded modules, and modules that contain no sharded module, are leaves: the trace only walks the
glue code between the batch and the sharded calls. From each sharded-module call the walk goes back
through getattr / getitem to the batch placeholder. A parameter-free leaf module on that path is a
postproc module, whose own arguments are walked the same way. A list, tuple or dict argument (fx
records it as such, holding nodes; a namedtuple as a call of its class) becomes a `Pack` whose items
are walked one by one, nested collections included. A leaf with trainable parameters, any other
operation, a value not derived from the batch, or an aggregate that cannot be rebuilt (a slice or
range of batch values, a dataclass built in forward) makes the module unpipelineable, with the
reason.
"""

from __future__ import annotations

import dataclasses
import operator
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from torch import fx, nn

from rewrite.arginfo import ArgInfo, Attr, CallArgs, Const, Item, Pack, PostprocCall, Step

__all__ = ["TraceResult", "Tracer", "trace_arg_infos"]


@dataclass(kw_only=True, slots=True)
class TraceResult:
    """Outcome of tracing, per sharded module FQN (relative to the unwrapped model)."""

    found: dict[str, CallArgs] = field(default_factory=dict)
    """Modules whose call arguments were traced back to the batch."""
    rejected: dict[str, str] = field(default_factory=dict)
    """Modules that cannot be pipelined, with the reason."""


class _Reject(Exception):
    pass


class Tracer(fx.Tracer):
    """torchrec's tracer, by its signature: sharded modules (and FSDP ones) are leaves, and so are
    the modules named in `leaf_modules` (with `extend_leaf_fqn`, their submodules too); any other
    module is traced through, as fx does. Buffers are not proxied (models that write to their
    buffers in forward stay traceable). `rewrite_model` traces with its own leaves: every module
    without a sharded descendant too."""

    proxy_buffer_attributes = False

    def __init__(self, leaf_modules: list[str] | None = None, extend_leaf_fqn: bool = False) -> None:
        super().__init__()
        self._leaves = set(leaf_modules or ())
        self._extend = extend_leaf_fqn

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
        from torchrec.distributed.types import ShardedModule

        name = module_qualified_name
        if isinstance(m, ShardedModule | FullyShardedDataParallel | FSDPModule) or name in self._leaves:
            return True
        if self._extend and any(name.startswith(leaf + ".") for leaf in self._leaves):
            return True
        return super().is_leaf_module(m, name)


class _LeafTracer(fx.Tracer):
    def __init__(self, sharded: set[str], with_sharded: set[str]) -> None:
        super().__init__()
        self._sharded = sharded
        self._with_sharded = with_sharded  # FQNs of modules that are or contain a sharded module

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return qualname in self._sharded or qualname not in self._with_sharded


def trace_arg_infos(
    model: nn.Module, sharded: dict[str, nn.Module], *, pipeline_postproc: bool
) -> TraceResult:
    """Trace `model.forward(batch)` and derive a CallArgs for each sharded module.

    Args:
        model: the unwrapped model (no DistributedModelParallel / DDP wrapper).
        sharded: the sharded modules by FQN relative to `model`.
        pipeline_postproc: whether parameter-free modules between the batch and a sharded module
            may be pipelined (run ahead with input_dist); otherwise such a module is rejected.

    Raises:
        Exception: whatever torch.fx raises when the forward cannot be traced (the caller falls
            back to direct lookup).
    """
    with_sharded = {""}
    for fqn in sharded:
        parts = fqn.split(".")
        with_sharded.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    graph = _LeafTracer(set(sharded), with_sharded).trace(model)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    calls = [n for n in graph.nodes if n.op == "call_module" and n.target in sharded]
    counts = Counter(n.target for n in calls)
    modules = dict(model.named_modules())
    result = TraceResult()
    for fqn in sharded:
        if counts[fqn] == 0:
            result.rejected[fqn] = "not called by the traced forward of the model"
        elif counts[fqn] > 1:
            result.rejected[fqn] = (
                f"called {counts[fqn]} times in one forward; a pipelined module's input_dist "
                "result can be consumed only once per batch"
            )
    module_calls = Counter(n.target for n in graph.nodes if n.op == "call_module")
    walker = _Walker(placeholders[:1], modules, module_calls, pipeline_postproc)
    for node in calls:
        if node.target in result.rejected:
            continue
        try:
            result.found[node.target] = walker.call_args(node)
        except _Reject as e:
            result.rejected[node.target] = str(e)
    return result


@dataclass(slots=True)
class _Walker:
    batch: list[fx.Node]
    modules: dict[str, nn.Module]
    calls: Counter[str]
    """How many times the traced forward calls each leaf module."""
    pipeline_postproc: bool

    def call_args(self, node: fx.Node) -> CallArgs:
        return CallArgs(
            args=self.items(node.args),
            kwargs={k: self.arg_info(v) for k, v in node.kwargs.items()},
        )

    def arg_info(self, value: object) -> ArgInfo:
        if isinstance(value, (list, tuple, dict)):
            return ArgInfo(source=self.pack(value))
        if not isinstance(value, fx.Node):
            if _holds_node(value):
                raise _Reject(
                    f"input passes a {type(value).__name__} built from batch values; only lists, "
                    "tuples and dicts of batch values can be rebuilt ahead"
                )
            return ArgInfo((Const(value),))
        steps: list[Step] = []
        node = value
        while True:
            if node.op == "placeholder":
                if node not in self.batch:
                    raise _Reject(f"input comes from forward argument {node.name!r}, not the batch")
                return ArgInfo(tuple(reversed(steps)))
            if node.op == "call_function" and node.target in (getattr, operator.getitem):
                if not isinstance(node.args[1], (str, int)):
                    raise _Reject(f"input indexed by a computed key at {node.format_node()}")
                step_type = Attr if node.target is getattr else Item
                steps.append(step_type(node.args[1]))
                node = node.args[0]
                continue
            if node.op == "call_module":
                return ArgInfo(tuple(reversed(steps)), source=self.postproc(node))
            if node.op == "call_function" and _is_namedtuple(node.target) and not node.kwargs:
                # fx records a namedtuple argument as a call of its class on the fields
                return ArgInfo(tuple(reversed(steps)), source=Pack(node.target, self.items(node.args)))
            raise _Reject(_why_not_from_batch(node))

    def pack(self, value: list | tuple | dict) -> Pack:
        """A Pack rebuilding `value` (fx's immutable list/dict become a plain list/dict)."""
        if isinstance(value, dict):
            return Pack(dict, self.items(value.values()), keys=tuple(value))
        return Pack(type(value) if isinstance(value, tuple) else list, self.items(value))

    def items(self, values: Iterable[object]) -> tuple[ArgInfo, ...]:
        return tuple(self.arg_info(v) for v in values)

    def postproc(self, node: fx.Node) -> PostprocCall:
        module = self.modules[node.target]
        if any(p.requires_grad for p in module.parameters()):
            raise _Reject(
                f"input is computed by module {node.target!r}, which has trainable parameters; "
                "it must run in forward, so its output cannot be distributed ahead"
            )
        if not self.pipeline_postproc:
            raise _Reject(
                f"input is computed by parameter-free module {node.target!r} (a postproc); "
                "pass pipeline_postproc=True to run it ahead with input_dist"
            )
        if self.calls[node.target] > 1:
            raise _Reject(
                f"input is computed by postproc module {node.target!r}, which forward calls "
                f"{self.calls[node.target]} times; its output is computed once per batch ahead, so "
                "every call would return the same value"
            )
        return PostprocCall(node.target, self.call_args(node))


def _is_namedtuple(target: object) -> bool:
    return isinstance(target, type) and issubclass(target, tuple) and hasattr(target, "_fields")


def _holds_node(value: object) -> bool:
    """Whether an aggregate fx keeps in a node's arguments (a slice, a range) holds a node."""
    found: list[fx.Node] = []
    fx.node.map_arg(value, found.append)
    return bool(found)


def _why_not_from_batch(node: fx.Node) -> str:
    if node.op == "get_attr":
        return f"input is the model attribute {node.target!r}, not derived from the batch"
    if node.op == "call_function" and dataclasses.is_dataclass(node.target):
        return (
            f"input is a {node.target.__name__} dataclass built inside forward ({node.format_node()}); "
            "only lists, tuples and dicts of batch values can be rebuilt ahead"
        )
    what = getattr(node.target, "__name__", node.target)
    return (
        f"input is computed by {node.op} {what!r} inside forward ({node.format_node()}); only "
        "attribute/item access on the batch, or a parameter-free module, can be run ahead"
    )
