"""Find the input of every call site of every sharded module: explicit, traced, direct, recorded.

`find_inputs` tries, per module, in this order (`method="auto"`): an explicit path or function; the
fx trace; where the trace fails, or does not see the module called, direct lookup in the batch; and
where that finds nothing either, the recording of the first forward (when the caller runs one,
`record=True`; then direct lookup's guesses are checked against that forward too). A trace that
rejects a module is final: direct lookup would find the raw KeyedJaggedTensor while the module
receives something else, and the recording would meet the same operation.

`complete` finishes the findings with the recorded forward: it fills in the recorded modules,
checks explicit functions (a mismatch raises), and checks the others' programs, replacing one that
disagrees with what forward passed by the recorded one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from rewrite.arginfo import CallArgs, PathError, parse_path
from rewrite.direct import match_direct
from rewrite.forwards import site_key
from rewrite.record import ObservedCall, Recording
from rewrite.report import ModuleReport, RewriteReport, SiteReport
from rewrite.sites import ExplicitInput, SiteInput, difference, explicit_entries
from rewrite.trace import trace_call_sites

__all__ = ["Finding", "Method", "complete", "find_inputs", "report_of"]

Method = Literal["auto", "explicit", "trace", "direct", "record"]

_WAITS = "waits for the recording of the first batch's forward (Rewrite.record)"


@dataclass(kw_only=True, slots=True)
class Finding:
    """How the input of one sharded module's call sites was found, or why not."""

    method: str | None
    """"explicit", "traced", "direct" or "recorded"; None when no method applies."""
    sites: list[SiteInput] = field(default_factory=list)
    """One per call site in call order (a single one with the reason when there is none)."""
    pending: bool = False
    """Waits for the recorded forward (to be found, or, for an explicit function, checked)."""

    @property
    def found(self) -> bool:
        return self.method is not None and not self.pending and all(s.args is not None for s in self.sites)


def _reject(reason: str, method: str | None = None) -> Finding:
    return Finding(method=method, sites=[SiteInput(reason=reason)])


def find_inputs(
    root: nn.Module,
    sharded: dict[str, nn.Module],
    batch: Any,
    *,
    method: Method,
    paths: dict[str, Any],
    pipeline_postproc: bool,
    record: bool,
) -> tuple[dict[str, Finding], str | None]:
    """Per sharded module FQN its Finding, in `sharded` order; and why the trace failed, if it did.

    Raises:
        PathError: a bad explicit path or function (see `rewrite_model`).
        ValueError: an explicit function, or `method="record"`, without `record`.
    """
    if method == "record" and not record:
        raise ValueError(
            "method='record' needs record=True: the caller runs the first forward in Rewrite.record"
        )
    found = {fqn: _explicit(fqn, spec, sharded, batch, record) for fqn, spec in paths.items()}
    rest = [fqn for fqn in sharded if fqn not in found]
    trace_error = None
    if rest and method in ("auto", "trace"):
        traced, trace_error = _trace(root, sharded, rest, batch, method, pipeline_postproc)
        found.update(traced)
        rest = [fqn for fqn in rest if fqn not in found]
    if rest and method in ("auto", "direct"):
        direct, why = match_direct(batch, {n: sharded[n] for n in rest})
        check = record and method == "auto"  # a guess: checked against the recorded forward
        found.update(
            {n: Finding(method="direct", sites=[SiteInput(args=a)], pending=check) for n, a in direct.items()}
        )
        if not check:
            found.update({n: _reject(r) for n, r in why.items()})
        rest = [fqn for fqn in rest if fqn not in found]
    if rest and method in ("auto", "record") and record:
        found.update(
            {n: Finding(method="recorded", pending=True, sites=[SiteInput(reason=_WAITS)]) for n in rest}
        )
        rest = []
    found.update({n: _reject(f"no explicit path given (method={method!r})") for n in rest})
    return {fqn: found[fqn] for fqn in sharded}, trace_error


def _trace(
    root: nn.Module,
    sharded: dict[str, nn.Module],
    rest: list[str],
    batch: Any,
    method: Method,
    postproc: bool,
) -> tuple[dict[str, Finding], str | None]:
    """The traced modules of `rest` (all of them with `method="trace"`), and the trace's error."""
    try:
        traced = trace_call_sites(root, sharded, pipeline_postproc=postproc, sample=batch)
    except Exception as e:  # fx raises many types on untraceable code
        error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return ({n: _reject(f"fx trace failed: {error}") for n in rest} if method == "trace" else {}), error
    return {
        n: Finding(method="traced", sites=traced.sites[n])
        for n in rest
        if n in traced.called or method == "trace"
    }, None


def _explicit(fqn: str, spec: Any, sharded: dict[str, nn.Module], batch: Any, record: bool) -> Finding:
    if fqn not in sharded:
        raise PathError(
            f"explicit path given for {fqn!r}, which is not a sharded module; sharded modules "
            f"(names relative to the unwrapped model): {sorted(sharded)}"
        )
    if callable(spec) and not isinstance(spec, str):
        if not record:
            raise ValueError(
                f"the explicit input of {fqn!r} is a function: it is checked against the first "
                "batch's forward, so the caller must record it (rewrite_model(..., record=True) and "
                "Rewrite.record)"
            )
        entries = explicit_entries(fqn, spec(batch))
        sites = [SiteInput(args=ExplicitInput(spec, i, fqn)) for i in range(len(entries))]
        return Finding(method="explicit", sites=sites, pending=True)
    # a torchrec-style ArgInfo (rewrite.torchrec_args) gives its own path
    info = spec.to_path() if hasattr(spec, "to_path") else parse_path(spec)
    try:
        value = info.resolve(batch)
    except Exception as e:
        raise PathError(f"path {spec!r} for {fqn!r} does not resolve on the batch: {e!r}") from e
    if not isinstance(value, KeyedJaggedTensor):
        raise PathError(
            f"path {spec!r} for {fqn!r} leads to a {type(value).__name__}, not a KeyedJaggedTensor"
        )
    return Finding(method="explicit", sites=[SiteInput(args=CallArgs(args=(info,)))])


def complete(
    findings: dict[str, Finding], recording: Recording, batch: Any, postproc: Callable[[Any, Any], Any]
) -> list[str]:
    """Finish `findings` (in place) with what the recorded forward passed; returns notes for the
    report.

    Args:
        findings: from `find_inputs`.
        recording: the recorded forward on `batch`.
        batch: the batch that forward received.
        postproc: the postproc runner for replaying programs on `batch`.

    Raises:
        PathError: an explicit input differs from what forward passed.
    """
    notes = []
    for fqn, finding in findings.items():
        calls = recording.calls.get(fqn, [])
        recorded = [c.input for c in calls]
        if finding.method == "recorded":
            findings[fqn] = Finding(
                method="recorded", sites=recorded or [SiteInput(reason="not called by the recorded forward")]
            )
            continue
        if not (finding.pending or finding.found):
            continue
        diff = _mismatch(fqn, finding.sites, calls, batch, postproc)
        if diff is None:
            finding.pending = False
        elif finding.method == "explicit":
            raise PathError(
                f"the explicit input of sharded module {fqn!r} differs from what forward passed: {diff}"
            )
        elif recorded and all(s.args is not None for s in recorded):
            notes.append(
                f"{fqn}: the {finding.method} input differs from what forward passed ({diff}); "
                "the recorded one is used"
            )
            findings[fqn] = Finding(method="recorded", sites=recorded)
        else:
            findings[fqn] = _reject(
                f"the {finding.method} input differs from what forward passed: {diff}", finding.method
            )
    return notes


def _mismatch(
    fqn: str,
    sites: list[SiteInput],
    calls: list[ObservedCall],
    batch: Any,
    postproc: Callable[[Any, Any], Any],
) -> str | None:
    """How the replayed inputs of `sites` differ from the recorded `calls`, or None."""
    if len(calls) != len(sites):
        return f"forward called it {len(calls)} time(s), for {len(sites)} call site(s)"
    cache: dict = {}
    for i, (site, call) in enumerate(zip(sites, calls, strict=True)):
        try:
            args, kwargs = site.args.build(batch, postproc, cache)
        except Exception as e:  # any failure of a user's function or a program's step
            return f"call site {site_key(fqn, i)}: replaying it fails: {type(e).__name__}: {e}"
        diff = difference(list(args), list(call.args), "arguments") or difference(
            kwargs, call.kwargs, "keyword arguments"
        )
        if diff is not None:
            return f"call site {site_key(fqn, i)}: {diff}"
    return None


def report_of(findings: dict[str, Finding], trace_error: str | None, notes: list[str]) -> RewriteReport:
    """The report of `findings` (see `RewriteReport`)."""
    report = RewriteReport(trace_error=trace_error, notes=notes)
    for fqn, finding in findings.items():
        sites = [
            SiteReport(
                key=site_key(fqn, i),
                program=None if s.args is None else str(s.args),
                reason=s.reason,
                source=s.source,
            )
            for i, s in enumerate(finding.sites)
        ]
        bad = next((s for s in sites if s.reason is not None), None)
        reason = None
        if bad is not None:
            reason = bad.detail() if len(sites) == 1 else f"call site {bad.key}: {bad.detail()}"
        elif finding.pending:
            reason = "to be checked against the recording of the first batch's forward (Rewrite.record)"
        path = "; ".join(s.program for s in sites) if bad is None else None
        report.modules.append(
            ModuleReport(
                fqn=fqn, pipelined=finding.found, method=finding.method, path=path, reason=reason, sites=sites
            )
        )
    return report
