"""Find each sharded module's call sites and their programs by torch.fx symbolic trace.

Sharded modules, and modules that contain no sharded module, are leaves: the trace only walks the
glue code between the batch and the sharded calls (`rewrite.walk` turns it into programs). A module
called k times gives k call sites, in trace order. The static KeyedJaggedTensor / JaggedTensor
constructors are patched for the trace so that each records one node (`rewrite.ops`), and nodes
carry the user's source line, which rejections name. Each traced program is replayed once on the
sample batch: one that fails there (say `.split()` on a tensor) is rejected with the error.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from torch import fx, nn

from rewrite.ops import traceable_constructors
from rewrite.sites import SiteInput, model_frame
from rewrite.walk import Walker

__all__ = ["TraceResult", "Tracer", "trace_call_sites"]


@dataclass(kw_only=True, slots=True)
class TraceResult:
    """Outcome of tracing: per sharded module FQN (relative to the unwrapped model), its call sites
    in call order (one site with a reason when the traced forward never calls it)."""

    sites: dict[str, list[SiteInput]] = field(default_factory=dict)
    called: set[str] = field(default_factory=set)
    """Modules the traced forward calls."""


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
    proxy_buffer_attributes = False

    def __init__(self, sharded: set[str], with_sharded: set[str]) -> None:
        super().__init__()
        # fx's own stack traces look every frame's source line up (linecache reads whole files):
        # 200 ms of a first step on a cold process. A rejection names one line: `create_node`
        # records just that frame's file and line.
        self.record_stack_traces = False
        self._sharded = sharded
        self._with_sharded = with_sharded  # FQNs of modules that are or contain a sharded module

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return qualname in self._sharded or qualname not in self._with_sharded

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        """fx's node, with the innermost frame of the model's code (`model_frame`) as its `stack_trace`
        (the line the report names), found by walking the frames without reading any source."""
        node = super().create_node(*args, **kwargs)
        frame = model_frame(sys._getframe(1))
        if frame is not None:
            code = frame.f_code
            node.stack_trace = f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}\n'
        return node


def trace_call_sites(
    model: nn.Module, sharded: dict[str, nn.Module], *, pipeline_postproc: bool, sample: Any = None
) -> TraceResult:
    """Trace `model.forward(batch)` and derive the program of each call site of each sharded module.

    Args:
        model: the unwrapped model (no DistributedModelParallel / DDP wrapper).
        sharded: the sharded modules by FQN relative to `model`.
        pipeline_postproc: whether parameter-free modules between the batch and a sharded module
            may be pipelined (run ahead with input_dist); otherwise such a module is rejected.
        sample: a batch to replay each program on once (None: not checked).

    Raises:
        Exception: whatever torch.fx raises when the forward cannot be traced.
    """
    with_sharded = {""}
    for fqn in sharded:
        parts = fqn.split(".")
        with_sharded.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    with traceable_constructors():
        graph = _LeafTracer(set(sharded), with_sharded).trace(model)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    module_calls = Counter(n.target for n in graph.nodes if n.op == "call_module")
    walker = Walker(
        placeholders[0] if placeholders else None,
        dict(model.named_modules()),
        module_calls,
        pipeline_postproc,
    )
    result = TraceResult()
    for node in graph.nodes:
        if node.op == "call_module" and node.target in sharded:
            site = walker.site(node)
            if sample is not None and site.args is not None and not site.args.postprocs():
                site = _replayed(site, sample)
            result.sites.setdefault(node.target, []).append(site)
            result.called.add(node.target)
    for fqn in sharded:
        result.sites.setdefault(fqn, [SiteInput(reason="not called by the traced forward of the model")])
    return result


def _replayed(site: SiteInput, sample: Any) -> SiteInput:
    """`site`, or its rejection when its program fails on the sample batch."""
    if site.args.is_path:
        return site
    try:
        site.args.build(sample, None, {})
    except Exception as e:  # any failure of the program's steps
        return SiteInput(
            reason=f"replaying `{site.args}` on the sample batch fails: {type(e).__name__}: {e}",
            source=site.source,
        )
    return site
