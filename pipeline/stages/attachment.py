"""`Attachment`: the rewrite of a model's sharded modules as `InputDist` holds it, from the first batch
to `detach`. `attach` rewrites the modules once (`rewrite.rewrite_model`), `recording` runs the
forward the rewrite may wait for, `settle` checks the complete rewrite once (the modules left
unpipelined warned about, then the owner's checks, then `free_features_storage_early` where forward
never reads the features), and `detach` undoes all of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from pipeline.config import RewriteOptions
from pipeline.stages.memory import free_early_where_safe
from pipeline.stages.not_pipelined import warn_not_pipelined
from rewrite import CallSite, ContextSlot, PipelinedModule, Rewrite, RewriteReport, rewrite_model

__all__ = ["Attachment"]


class Attachment:
    """The rewrite of `model`'s sharded modules, made on the first batch and undone by `detach`.

    Args:
        model: the model whose sharded modules are rewritten.
        slot: where the hijacked forwards read the context of the batch whose forward runs.
        options: how the sharded modules' inputs are found (`RewriteOptions`).
        strict: fail on the first batch if a sharded module cannot be pipelined.
        pipeline_postproc: run parameter-free modules that transform the batch ahead.
        forward: which hijacked forward the sharded modules get (see `InputDist`).
        free_early: `free_features_storage_early` was asked for.
    """

    def __init__(
        self,
        model: nn.Module,
        slot: ContextSlot,
        *,
        options: RewriteOptions,
        strict: bool,
        pipeline_postproc: bool,
        forward: str,
        free_early: bool,
    ) -> None:
        self._model, self._slot, self._options = model, slot, options
        self._strict, self._pipeline_postproc = strict, pipeline_postproc
        self._forward, self._asked_free_early = forward, free_early
        self.rewrite: Rewrite | None = None
        """The rewrite, from the first batch until `detach`."""
        self.settled = False
        """The complete rewrite was checked (`settle`)."""
        self.free_early = False
        """`free_features_storage_early` applies (every call site's input is a path in the batch)."""
        self._undo: list[Callable[[], None]] = []
        self._warned: set[str] = set()
        """The sharded modules warned about as not pipelined (once each, not at a re-attach)."""

    @property
    def report(self) -> RewriteReport | None:
        return self.rewrite.report if self.rewrite is not None else None

    @property
    def modules(self) -> list[PipelinedModule]:
        """The pipelined sharded modules (none before the first batch)."""
        return self.rewrite.modules if self.rewrite is not None else []

    @property
    def sites(self) -> list[CallSite]:
        """Every call of a pipelined sharded module in one forward (none before the first batch)."""
        return self.rewrite.sites if self.rewrite is not None else []

    def use_forward(self, forward: str) -> None:
        """Change which hijacked forward the sharded modules get, before the first batch rewrote them.

        Raises:
            RuntimeError: the modules are rewritten already.
        """
        if self.rewrite is not None:
            raise RuntimeError("the sharded modules are rewritten already; detach() first")
        self._forward = forward

    def attach(self, batch: Any) -> Rewrite:
        """Rewrite the model's sharded modules, once, with `batch` as the sample. The rewrite may
        wait for the first forward to be recorded (`recording`) before anything is pipelined."""
        if self.rewrite is None:
            options = self._options
            self.rewrite = rewrite_model(
                self._model,
                batch,
                slot=self._slot,
                prefetch=self._forward == "prefetch",
                lookup=self._forward == "lookup",
                method=options.method,
                paths=options.arg_paths,
                pipeline_postproc=self._pipeline_postproc,
                strict=self._strict,
                record=True,
            )
            self.settled = False
        return self.rewrite

    def recording(self, batch: Any) -> Any:
        """While the rewrite waits for a recorded forward: the context manager to run the forward of
        `batch` in (unpipelined, the plain loop's numbers; it completes the rewrite). None
        otherwise: the forward is pipelined, and its calls are to be checked after it."""
        rewrite = self.attach(batch)
        return rewrite.record(batch) if rewrite.needs_recording else None

    def settle(self, rewrite: Rewrite, check: Callable[[Rewrite], None]) -> None:
        """Once the rewrite is complete: warn about each module not pipelined (once per module), run
        the owner's `check` (it may raise on every rank), then apply `free_features_storage_early`
        where forward never reads the features."""
        self.settled = True
        warn_not_pipelined(rewrite.report, self._warned, pipeline_postproc=self._pipeline_postproc)
        check(rewrite)
        undo = free_early_where_safe(rewrite) if self._asked_free_early else None
        self.free_early = undo is not None
        if undo is not None:
            self._undo.append(undo)

    def detach(self) -> None:
        """Undo `free_features_storage_early` and restore every original forward; the next
        `attach` rewrites again."""
        while self._undo:
            self._undo.pop()()
        if self.rewrite is not None:
            self.rewrite.restore()
            self.rewrite = None
        self.settled = self.free_early = False
