"""rewrite_model: replace each pipelineable sharded module's forward, and put everything back.

The model's code never changes: each sharded module (and each pipelined postproc module) gets an
instance attribute `forward` holding a hijacked forward. Detaching deletes exactly those attributes
(or restores the instance attribute that was there before), so the detached model computes what it
did before the rewrite, and `state_dict()` keys never change, since hijacked forwards are not modules.

A module called k times in one forward has k call sites (`CallSite`). Where only a recorded forward
can tell (`record=True`), the Rewrite waits for the first batch's forward in `Rewrite.record`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from torch import nn
from torchrec.distributed.types import ShardedModule

from rewrite.find import Finding, Method, complete, find_inputs, report_of
from rewrite.forwards import (
    ContextSlot,
    LookupPipelinedForward,
    PipelinedForward,
    PostprocForward,
    PrefetchPipelinedForward,
    site_key,
)
from rewrite.record import record_calls
from rewrite.replay import Replay
from rewrite.report import RewriteReport
from rewrite.sites import CallSite, PipelinedModule

__all__ = ["Method", "Rewrite", "outermost_sharded", "rewrite_model", "unwrap_model"]

_MISSING = object()


@dataclass(kw_only=True, slots=True)
class _Findings:
    """What `rewrite_model` found, kept until the forwards are hijacked (after the recording)."""

    root: nn.Module
    sharded: dict[str, ShardedModule]
    findings: dict[str, Finding]
    trace_error: str | None
    forward_type: type
    strict: bool


@dataclass(kw_only=True, slots=True)
class Rewrite(Replay):
    """The result of `rewrite_model`: what was pipelined, and the means to undo it. What it does
    for each batch (`site_inputs`, `fuse_splits`) is its `Replay`."""

    report: RewriteReport
    postprocs: dict[str, nn.Module] = field(default_factory=dict)
    """Postproc modules run ahead with input_dist, by FQN."""
    _named: dict[str, nn.Module] = field(default_factory=dict)
    _slot: ContextSlot | None = None
    _pending: _Findings | None = None
    _saved: list[tuple[nn.Module, Any, bool]] = field(default_factory=list)

    def signature(self) -> str:
        """Each pipelined call site's key and program, one a line. Every rank must have the same
        before the first input_dist: a forward whose calls depend on the data can record
        differently on different ranks, and the input all-to-alls would then not match."""
        return "\n".join(f"{site.key}: {site.args}" for site in self.sites)

    @contextmanager
    def record(self, batch: Any) -> Iterator[None]:
        """Run the model's forward on `batch` inside this block to complete a pending Rewrite.

        Contract: while `needs_recording`, nothing is hijacked and `modules` is empty, so the
        forward inside runs unpipelined (the plain loop's numbers); no input_dist may have started
        for any batch. On normal exit the recorded calls complete the rewrite (programs found,
        explicit functions and direct guesses checked, final report, forwards hijacked); input_dist
        starts with the next batch. If forward raises, every recording patch is undone and the
        Rewrite stays pending. Without `needs_recording` the block just runs.

        Raises:
            PathError: an explicit input differs from what forward passed (on exit).
            RewriteError: strict mode and some module cannot be pipelined (on exit).
        """
        pending = self._pending
        if pending is None:
            yield
            return
        with record_calls(pending.root, batch, pending.sharded) as recording:
            yield
        notes = complete(pending.findings, recording, batch, partial(self.run_postproc, results={}))
        self._finish(pending, notes)

    def restore(self) -> None:
        """Put back every original forward and remove everything the rewrite added."""
        self._pending, self.needs_recording = None, False
        self.unfuse_splits()
        for module, previous, was_pipelined in reversed(self._saved):
            if previous is _MISSING:
                vars(module).pop("forward", None)
            else:
                module.forward = previous
            if isinstance(module, ShardedModule):
                module.is_pipelined = was_pipelined
        self._saved.clear()
        if self._slot is not None:
            for m in self.modules:
                self._slot.forget(m.fqn)

    def _hijack(self, module: nn.Module, forward: Any) -> None:
        self._saved.append(
            (module, vars(module).get("forward", _MISSING), getattr(module, "is_pipelined", False))
        )
        module.forward = forward
        if isinstance(module, ShardedModule):
            module.is_pipelined = True

    def _finish(self, found: _Findings, notes: list[str]) -> None:
        """The final report (keeping the notes written on the pending one), the strict check, then
        every found module's forward hijacked."""
        self._pending, self.needs_recording = None, False
        self.report = report_of(found.findings, found.trace_error, [*self.report.notes, *notes])
        if found.strict:
            self.report.check_strict()
        slot = self._slot
        for fqn, finding in found.findings.items():
            if not finding.found:
                continue
            module = found.sharded[fqn]
            sites = tuple(
                CallSite(key=site_key(fqn, i), fqn=fqn, index=i, module=module, args=s.args)
                for i, s in enumerate(finding.sites)
            )
            self.add(PipelinedModule(fqn=fqn, module=module, args=sites[0].args, sites=sites))
            slot.expect(fqn, tuple(s.key for s in sites))
            self._hijack(module, found.forward_type(fqn, module, slot))
            for call in (c for s in sites for c in s.args.postprocs()):
                if call.fqn not in self.postprocs:
                    module = self.postprocs[call.fqn] = self._named[call.fqn]
                    self._hijack(module, PostprocForward(call.fqn, module, slot))


def rewrite_model(
    model: nn.Module,
    batch: Any,
    *,
    slot: ContextSlot,
    prefetch: bool = False,
    lookup: bool = False,
    method: Method = "auto",
    paths: dict[str, Any] | None = None,
    pipeline_postproc: bool = False,
    strict: bool = False,
    record: bool = False,
) -> Rewrite:
    """Hijack the forward of every sharded module whose input can be built from the batch.

    Args:
        model: the model the pipeline calls (DistributedModelParallel or the plain module).
        batch: a sample batch, as the model will receive it (on the device).
        slot: where the pipeline puts the current batch's context for the hijacked forwards; it
            also counts each module's calls per forward (`ContextSlot.check_calls`).
        prefetch: install `PrefetchPipelinedForward` (inputs come from the prefetch stage).
        lookup: install `LookupPipelinedForward` (the pipeline runs `compute_and_output_dist`
            itself, ahead of forward).
        method: "auto" (explicit, then fx trace, then direct lookup where the trace fails or does
            not see a module called, then recording), or only "explicit", "trace", "direct" or
            "record".
        paths: explicit inputs by module FQN (relative to the unwrapped model): a path
            (`"sparse_features"`, or a torchrec-style ArgInfo of attribute and item steps), or a
            function from a batch to the module's inputs, one entry per call in forward (a
            KeyedJaggedTensor, or an `(args, kwargs)` pair): `lambda b: [b.history, b.candidates]`.
            Functions are checked against the recorded first forward (they need `record`).
        pipeline_postproc: run parameter-free modules that transform the batch ahead with
            input_dist (traced method only) instead of leaving their consumer unpipelined.
        strict: raise instead of leaving a module running its original forward.
        record: the caller runs the first forward in `Rewrite.record` when `needs_recording`;
            without it, modules only a recorded forward could resolve stay unpipelined.

    Returns:
        The Rewrite; `Rewrite.restore()` undoes it exactly.

    Raises:
        PathError: an explicit path or function is malformed, names no sharded module, or does
            not lead to a KeyedJaggedTensor in the batch.
        RewriteError: strict mode and some module cannot be pipelined (with `record`, possibly
            only when the recording completes).
    """
    root = unwrap_model(model)
    sharded = outermost_sharded(root)
    findings, trace_error = find_inputs(
        root,
        sharded,
        batch,
        method=method,
        paths=paths or {},
        pipeline_postproc=pipeline_postproc,
        record=record,
    )
    named = dict(root.named_modules())
    postprocs = {
        call.fqn
        for finding in findings.values()
        for site in finding.sites
        if site.args is not None
        for call in site.args.postprocs()
    }
    rewrite = Rewrite(
        report=RewriteReport(),
        postproc_forwards={fqn: named[fqn].forward for fqn in postprocs},  # before any is hijacked
        _named=named,
        _slot=slot,
    )
    forward_type = (
        LookupPipelinedForward if lookup else PrefetchPipelinedForward if prefetch else PipelinedForward
    )
    found = _Findings(
        root=root,
        sharded=sharded,
        findings=findings,
        trace_error=trace_error,
        forward_type=forward_type,
        strict=strict,
    )
    if any(f.pending for f in findings.values()):
        rewrite._pending, rewrite.needs_recording = found, True
        rewrite.report = report_of(findings, trace_error, [])
        if strict:  # what no recording can change fails now
            RewriteReport(
                modules=[m for m in rewrite.report.modules if not findings[m.fqn].pending]
            ).check_strict()
    else:
        rewrite._finish(found, [])
    return rewrite


# -- where the sharded modules are: under the model's wrappers, and which own an input -------------


def unwrap_model(model: nn.Module) -> nn.Module:
    """Peel DistributedModelParallel and DDP/FSDP-style wrappers (anything with `.module`)."""
    while True:
        inner = getattr(model, "_dmp_wrapped_module", None)
        if inner is None and type(model).__name__ in ("DistributedDataParallel", "FullyShardedDataParallel"):
            inner = model.module
        if not isinstance(inner, nn.Module):
            return model
        model = inner


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
