"""The hijacked forwards installed as `module.forward`, and the context interface they read.

rewrite/ does not know about streams or pipelines. A hijacked forward asks the context the pipeline
put in its `ContextSlot` for what was prepared for this batch; the context is responsible for waiting
and for the cross-stream hand-off. A forward called when nothing was prepared fails with a message
that says how to run the model directly.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import nn

__all__ = [
    "ContextSlot",
    "ForwardContext",
    "LookupPipelinedForward",
    "NotPreparedError",
    "PipelinedForward",
    "PostprocForward",
    "PrefetchPipelinedForward",
]


class NotPreparedError(RuntimeError):
    """A hijacked forward ran without the pipeline having prepared its input."""


class ForwardContext(Protocol):
    """What the pipeline's per-batch context offers the hijacked forwards.

    Each `take_*` method returns None when nothing is prepared under that name (for instance a
    second call of the same module in one forward); a returned value is removed from the context.
    """

    def take_input_dist(self, fqn: str) -> tuple[Any, Any] | None:
        """`(module_ctx, dist_input)` once the input_dist of `fqn` is complete and usable on the
        current stream (waits for the all-to-all)."""

    def take_prefetched(self, fqn: str) -> tuple[Any, Any] | None:
        """`(module_ctx, dist_input)` after the prefetch stage; never waits on communication."""

    def postproc_result(self, fqn: str) -> Any | None:
        """The output of postproc module `fqn` computed ahead for this batch."""

    def take_lookup(self, fqn: str) -> Any | None:
        """The output of `compute_and_output_dist` of `fqn`, run ahead of forward by the pipeline
        (embedding lookup pipelines); usable on the current stream."""


class ContextSlot:
    """Holds the context of the batch whose forward is running; None between forwards."""

    __slots__ = ("current",)

    def __init__(self) -> None:
        self.current: ForwardContext | None = None


def _not_prepared(fqn: str, what: str) -> NotPreparedError:
    return NotPreparedError(
        f"{what} of sharded module {fqn!r} is not prepared for this call. Either the model was "
        "called directly while a pipeline is attached to it, or the module ran twice in one "
        "forward. To run the model outside the pipeline, call pipeline.detach() first (the next "
        "progress() re-attaches)."
    )


class _HijackedForward:
    """Common state: which module, under which name, reading which slot."""

    _take = ""  # the ForwardContext method that hands over what was prepared
    _what = ""

    def __init__(self, fqn: str, module: nn.Module, slot: ContextSlot) -> None:
        self.fqn = fqn
        self.module = module
        self.slot = slot

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ctx = self.slot.current
        prepared = None if ctx is None else getattr(ctx, self._take)(self.fqn)
        if prepared is None:
            raise _not_prepared(self.fqn, self._what)
        module_ctx, dist_input = prepared
        return self.module.compute_and_output_dist(module_ctx, dist_input)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.fqn!r})"


class PipelinedForward(_HijackedForward):
    """Runs `compute_and_output_dist` on the input_dist result the pipeline started earlier."""

    _take = "take_input_dist"
    _what = "The input_dist result"


class PrefetchPipelinedForward(_HijackedForward):
    """Runs `compute_and_output_dist` on the post-prefetch input; no wait on communication."""

    _take = "take_prefetched"
    _what = "The prefetched input"


class LookupPipelinedForward(_HijackedForward):
    """Returns the lookup (`compute_and_output_dist`) the pipeline already ran for this batch."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ctx = self.slot.current
        result = None if ctx is None else ctx.take_lookup(self.fqn)
        if result is None:
            raise _not_prepared(self.fqn, "The embedding lookup")
        return result


class PostprocForward(_HijackedForward):
    """Returns the postproc output computed ahead with input_dist instead of recomputing it."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ctx = self.slot.current
        result = None if ctx is None else ctx.postproc_result(self.fqn)
        if result is None:
            raise _not_prepared(self.fqn, "The output of postproc module")
        return result
