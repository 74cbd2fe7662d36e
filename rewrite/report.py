"""RewriteReport: what the rewrite did to each sharded module, and why."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ModuleReport", "RewriteError", "RewriteReport"]


class RewriteError(RuntimeError):
    """Strict mode: some sharded modules could not be pipelined."""


@dataclass(kw_only=True, slots=True)
class ModuleReport:
    """One sharded module."""

    fqn: str
    """Name relative to the unwrapped model."""
    pipelined: bool
    method: str | None = None
    """How the ArgInfo was found: "explicit", "traced" or "direct"."""
    path: str | None = None
    """The call's arguments as paths from the batch, e.g. `batch.sparse_features`."""
    reason: str | None = None
    """Why it is left running its original forward."""


@dataclass(kw_only=True, slots=True)
class RewriteReport:
    """Per sharded module FQN: pipelined or not, how, and why not."""

    modules: list[ModuleReport] = field(default_factory=list)
    trace_error: str | None = None
    """Why the fx trace failed, when direct lookup was used as the fallback."""
    notes: list[str] = field(default_factory=list)
    """What the pipeline decided about the rewritten modules (e.g. a prefetch stage with nothing
    to do), one sentence each."""

    @property
    def pipelined(self) -> list[str]:
        return [m.fqn for m in self.modules if m.pipelined]

    @property
    def not_pipelined(self) -> list[ModuleReport]:
        return [m for m in self.modules if not m.pipelined]

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
                "Give explicit paths for them, or construct the pipeline with strict=False to let "
                "them run their original forward."
            )

    def __str__(self) -> str:
        rows = [("module", "pipelined", "method", "input / reason")]
        for m in self.modules:
            detail = m.path if m.pipelined else m.reason
            rows.append((m.fqn, "yes" if m.pipelined else "no", m.method or "-", detail or ""))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = ["  ".join(r[i].ljust(widths[i]) for i in range(3)) + "  " + r[3] for r in rows]
        if self.trace_error:
            lines.append(f"(fx trace failed, direct lookup used: {self.trace_error})")
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)
