"""RewriteReport: what the rewrite did to each sharded module and each of its call sites, and why."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ModuleReport", "RewriteError", "RewriteReport", "SiteReport"]


class RewriteError(RuntimeError):
    """Strict mode: some sharded modules could not be pipelined."""


@dataclass(kw_only=True, slots=True)
class SiteReport:
    """One call of a sharded module in forward."""

    key: str
    """The call site's key (`rewrite.forwards.site_key`): the FQN for the first call, then `fqn@1`..."""
    program: str | None = None
    """The program replayed for it, as Python: `batch.sparse.split([2, 3])[0]`."""
    reason: str | None = None
    """Why its input cannot be computed ahead."""
    source: str | None = None
    """The user's source line (`file:line`) of the call, or of the step that was rejected."""

    def detail(self) -> str:
        text = self.program if self.reason is None else self.reason
        return f"{text} (at {self.source})" if self.source else text or ""


@dataclass(kw_only=True, slots=True)
class ModuleReport:
    """One sharded module."""

    fqn: str
    """Name relative to the unwrapped model."""
    pipelined: bool
    method: str | None = None
    """How its input was found: "explicit", "traced", "direct" or "recorded"."""
    path: str | None = None
    """The programs of its call sites (`; ` between sites), e.g. `batch.sparse_features`."""
    reason: str | None = None
    """Why it is left running its original forward."""
    sites: list[SiteReport] = field(default_factory=list)
    """Its call sites in call order."""


@dataclass(kw_only=True, slots=True)
class RewriteReport:
    """Per sharded module FQN: pipelined or not, how, and why not; per call site, its program."""

    modules: list[ModuleReport] = field(default_factory=list)
    trace_error: str | None = None
    """Why the fx trace failed, when another method was used instead."""
    notes: list[str] = field(default_factory=list)
    """What the rewrite and the pipeline decided beyond each module's line, one sentence each."""

    @property
    def pipelined(self) -> list[str]:
        return [m.fqn for m in self.modules if m.pipelined]

    @property
    def not_pipelined(self) -> list[ModuleReport]:
        return [m for m in self.modules if not m.pipelined]

    @property
    def sites(self) -> list[SiteReport]:
        """Every call site of every module, module by module."""
        return [s for m in self.modules for s in m.sites]

    def check_strict(self) -> None:
        """Raise if any sharded module is not pipelined.

        Raises:
            RewriteError: listing every such module with its reason.
        """
        missing = self.not_pipelined
        if missing:
            lines = "\n".join(f"  {m.fqn}: {m.reason}" for m in missing)
            raise RewriteError(
                f"strict rewrite: {len(missing)} sharded module(s) cannot be pipelined:\n{lines}\n"
                "Give explicit inputs for them (a path, or a function from the batch to the input of "
                "each call), or construct the pipeline with strict=False to let them run their "
                "original forward."
            )

    def __str__(self) -> str:
        rows = [("module / call site", "pipelined", "method", "input / reason")]
        for m in self.modules:
            for site in m.sites:
                rows.append((site.key, "yes" if m.pipelined else "no", m.method or "-", site.detail()))
            if not m.sites:
                rows.append((m.fqn, "yes" if m.pipelined else "no", m.method or "-", m.reason or ""))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = ["  ".join(r[i].ljust(widths[i]) for i in range(3)) + "  " + r[3] for r in rows]
        if self.trace_error:
            also = ", then the recording" if any(m.method == "recorded" for m in self.modules) else ""
            lines.append(f"(fx trace failed, direct lookup used{also}: {self.trace_error})")
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)
