"""rewrite_model: replace each pipelineable sharded module's forward, and put everything back.

The model's code never changes: each sharded module (and each pipelined postproc module) gets an
instance attribute `forward` holding a hijacked forward. Detaching deletes exactly those attributes
(or restores the instance attribute that was there before), so the detached model computes what it
did before the rewrite, and `state_dict()` keys never change, since hijacked forwards are not modules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import nn
from torchrec.distributed.types import ShardedModule

from rewrite.arginfo import CallArgs, PathError, parse_path
from rewrite.direct import match_direct
from rewrite.forwards import (
    ContextSlot,
    LookupPipelinedForward,
    PipelinedForward,
    PostprocForward,
    PrefetchPipelinedForward,
)
from rewrite.report import ModuleReport, RewriteReport
from rewrite.splits import input_dists_ready, install_fused_splits
from rewrite.trace import trace_arg_infos

__all__ = ["Method", "PipelinedModule", "Rewrite", "outermost_sharded", "rewrite_model", "unwrap_model"]

Method = Literal["auto", "explicit", "trace", "direct"]
_MISSING = object()


def unwrap_model(model: nn.Module) -> nn.Module:
    """Peel DistributedModelParallel and DDP/FSDP-style wrappers (anything with `.module`)."""
    while True:
        inner = getattr(model, "_dmp_wrapped_module", None)
        if inner is None and type(model).__name__ in (
            "DistributedDataParallel",
            "FullyShardedDataParallel",
        ):
            inner = model.module
        if not isinstance(inner, nn.Module):
            return model
        model = inner


@dataclass(kw_only=True, slots=True)
class PipelinedModule:
    """A sharded module whose forward was hijacked, and how to build its input from a batch."""

    fqn: str
    module: ShardedModule
    args: CallArgs


@dataclass(kw_only=True, slots=True)
class Rewrite:
    """The result of `rewrite_model`: what was pipelined, and the means to undo it."""

    report: RewriteReport
    modules: list[PipelinedModule]
    postprocs: dict[str, nn.Module]
    """Postproc modules run ahead with input_dist, by FQN."""
    _saved: list[tuple[nn.Module, Any, bool]] = field(default_factory=list)
    _undo_fuse: Callable[[], None] | None = None

    def fuse_splits(self) -> bool:
        """Fuse the splits all-to-alls once every input dist exists; True when fused."""
        modules = [m.module for m in self.modules]
        if self._undo_fuse is None and input_dists_ready(modules):
            self._undo_fuse = install_fused_splits(modules)
        return self._undo_fuse is not None

    def restore(self) -> None:
        """Put back every original forward and remove everything the rewrite added."""
        if self._undo_fuse is not None:
            self._undo_fuse()
            self._undo_fuse = None
        for module, previous, was_pipelined in reversed(self._saved):
            if previous is _MISSING:
                vars(module).pop("forward", None)
            else:
                module.forward = previous
            if isinstance(module, ShardedModule):
                module.is_pipelined = was_pipelined
        self._saved.clear()

    def run_postproc(self, call: Any, batch: Any, cache: dict[str, Any]) -> Any:
        """Run postproc `call` on `batch` with its original forward, once per batch (`cache`)."""
        if call.fqn not in cache:
            args, kwargs = call.args.build(batch, lambda c, b: self.run_postproc(c, b, cache))
            original = self._original_forward(self.postprocs[call.fqn])
            cache[call.fqn] = original(*args, **kwargs)
        return cache[call.fqn]

    def _original_forward(self, module: nn.Module) -> Callable[..., Any]:
        for saved, previous, _ in self._saved:
            if saved is module and previous is not _MISSING:
                return previous
        return type(module).forward.__get__(module)

    def _hijack(self, module: nn.Module, forward: Any) -> None:
        self._saved.append(
            (module, vars(module).get("forward", _MISSING), getattr(module, "is_pipelined", False))
        )
        module.forward = forward
        if isinstance(module, ShardedModule):
            module.is_pipelined = True


def rewrite_model(
    model: nn.Module,
    batch: Any,
    *,
    slot: ContextSlot,
    prefetch: bool = False,
    lookup: bool = False,
    method: Method = "auto",
    paths: dict[str, str] | None = None,
    pipeline_postproc: bool = False,
    strict: bool = False,
) -> Rewrite:
    """Hijack the forward of every sharded module whose input can be built from the batch.

    Args:
        model: the model the pipeline calls (DistributedModelParallel or the plain module).
        batch: a sample batch, as the model will receive it (on the device).
        slot: where the pipeline puts the current batch's context for the hijacked forwards.
        prefetch: install `PrefetchPipelinedForward` (inputs come from the prefetch stage).
        lookup: install `LookupPipelinedForward` (the pipeline runs `compute_and_output_dist`
            itself, ahead of forward).
        method: "auto" (explicit paths, then fx trace, falling back to direct lookup when the
            trace fails), or only "explicit", "trace" or "direct".
        paths: `{module_fqn: path}` for explicit ArgInfos, e.g. `{"sparse_arch.ebc":
            "sparse_features"}`; FQNs are relative to the unwrapped model.
        pipeline_postproc: run parameter-free modules that transform the batch ahead with
            input_dist (traced method only) instead of leaving their consumer unpipelined.
        strict: raise instead of leaving a module running its original forward.

    Returns:
        The Rewrite; `Rewrite.restore()` undoes it exactly.

    Raises:
        PathError: an explicit path is malformed, names no sharded module, or does not lead to a
            KeyedJaggedTensor in the batch.
        RewriteError: strict mode and some module cannot be pipelined.
    """
    root = unwrap_model(model)
    sharded = outermost_sharded(root)
    found, report = _find_arg_infos(root, sharded, batch, method, paths or {}, pipeline_postproc)
    if strict:
        report.check_strict()
    rewrite = Rewrite(report=report, modules=[], postprocs={})
    modules = dict(root.named_modules())
    forward_type = (
        LookupPipelinedForward if lookup else PrefetchPipelinedForward if prefetch else PipelinedForward
    )
    for fqn, (args, _) in found.items():
        rewrite.modules.append(PipelinedModule(fqn=fqn, module=sharded[fqn], args=args))
        rewrite._hijack(sharded[fqn], forward_type(fqn, sharded[fqn], slot))
        for call in args.postprocs():
            if call.fqn not in rewrite.postprocs:
                rewrite.postprocs[call.fqn] = modules[call.fqn]
                rewrite._hijack(modules[call.fqn], PostprocForward(call.fqn, modules[call.fqn], slot))
    return rewrite


def outermost_sharded(root: nn.Module) -> dict[str, ShardedModule]:
    """The sharded modules of `root` by FQN, leaving out those inside another sharded module.

    A sharded module nested in another (the EmbeddingBagCollection of a sharded
    FeatureProcessedEmbeddingBagCollection) is part of its parent's implementation: the parent calls
    it directly, never through the model's forward, so it has no input of its own to distribute.
    """
    found: dict[str, ShardedModule] = {}
    for fqn, module in root.named_modules():  # parents come before their children
        if isinstance(module, ShardedModule) and not any(fqn.startswith(f"{p}.") for p in found):
            found[fqn] = module
    return found


def _find_arg_infos(
    root: nn.Module,
    sharded: dict[str, nn.Module],
    batch: Any,
    method: Method,
    paths: dict[str, str],
    pipeline_postproc: bool,
) -> tuple[dict[str, tuple[CallArgs, str]], RewriteReport]:
    found = {fqn: (args, "explicit") for fqn, args in _explicit(paths, sharded, batch).items()}
    rejected: dict[str, str] = {}
    report = RewriteReport()
    rest = {n: m for n, m in sharded.items() if n not in found}
    if rest and method in ("auto", "trace"):
        try:
            traced = trace_arg_infos(root, sharded, pipeline_postproc=pipeline_postproc)
        except Exception as e:  # fx raises many types on untraceable code
            report.trace_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            if method == "trace":
                rejected.update({n: f"fx trace failed: {report.trace_error}" for n in rest})
                rest = {}
        else:
            found.update({n: (a, "traced") for n, a in traced.found.items() if n in rest})
            rejected.update({n: r for n, r in traced.rejected.items() if n in rest})
            rest = {}
    if rest and method in ("auto", "direct"):
        direct, why = match_direct(batch, rest)
        found.update({n: (a, "direct") for n, a in direct.items()})
        rejected.update(why)
        rest = {}
    rejected.update({n: f"no explicit path given (method={method!r})" for n in rest})
    for fqn in sharded:
        if fqn in found:
            args, how = found[fqn]
            report.modules.append(ModuleReport(fqn=fqn, pipelined=True, method=how, path=str(args)))
        else:
            report.modules.append(ModuleReport(fqn=fqn, pipelined=False, reason=rejected[fqn]))
    return found, report


def _explicit(paths: dict[str, Any], sharded: dict[str, nn.Module], batch: Any) -> dict:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    out = {}
    for fqn, text in paths.items():
        if fqn not in sharded:
            raise PathError(
                f"explicit path given for {fqn!r}, which is not a sharded module; sharded modules "
                f"(names relative to the unwrapped model): {sorted(sharded)}"
            )
        # a torchrec-style ArgInfo (rewrite.torchrec_args) gives its own path
        info = text.to_path() if hasattr(text, "to_path") else parse_path(text)
        try:
            value = info.resolve(batch)
        except Exception as e:
            raise PathError(f"path {text!r} for {fqn!r} does not resolve on the batch: {e!r}") from e
        if not isinstance(value, KeyedJaggedTensor):
            raise PathError(
                f"path {text!r} for {fqn!r} leads to a {type(value).__name__}, not a KeyedJaggedTensor"
            )
        out[fqn] = CallArgs(args=(info,))
    return out
