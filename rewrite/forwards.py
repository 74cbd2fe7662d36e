"""The hijacked forwards installed as `module.forward`, and the context interface they read.

rewrite/ does not know about streams or pipelines. A hijacked forward asks the context the pipeline
put in its `ContextSlot` for what was prepared for this batch; the context is responsible for waiting
and for the cross-stream hand-off. A sharded module called k times in one forward has k call sites;
the slot counts the calls, so that call j takes what was prepared under the key of site j
(`site_key`). A forward called when nothing was prepared fails with a message that says how to run
the model directly.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import nn

__all__ = [
    "CallCountError",
    "ContextSlot",
    "ForwardContext",
    "LookupPipelinedForward",
    "NotPreparedError",
    "PipelinedForward",
    "PostprocForward",
    "PrefetchPipelinedForward",
    "site_key",
]


class NotPreparedError(RuntimeError):
    """A hijacked forward ran without the pipeline having prepared its input."""


class CallCountError(NotPreparedError):
    """A pipelined module was called more, or fewer, times in one forward than it has call sites."""


def site_key(fqn: str, index: int) -> str:
    """The key of call `index` (from 0) of sharded module `fqn` in one forward: `fqn` itself for the
    first call, `fqn@1`, `fqn@2`, ... for the next ones. Contexts key what they prepare by it."""
    return fqn if index == 0 else f"{fqn}@{index}"


class ForwardContext(Protocol):
    """What the pipeline's per-batch context offers the hijacked forwards.

    `key` is a call site's key (`site_key`: the module's FQN for its first call). Each `take_*`
    method returns None when nothing is prepared under that key; a returned value is removed from
    the context.
    """

    def take_input_dist(self, key: str) -> tuple[Any, Any] | None:
        """`(module_ctx, dist_input)` once the input_dist of call site `key` is complete and usable
        on the current stream (waits for the all-to-all)."""

    def take_prefetched(self, key: str) -> tuple[Any, Any] | None:
        """`(module_ctx, dist_input)` after the prefetch stage; never waits on communication."""

    def postproc_result(self, fqn: str) -> Any | None:
        """The output of postproc module `fqn` computed ahead for this batch."""

    def take_lookup(self, key: str) -> Any | None:
        """The output of `compute_and_output_dist` of call site `key`, run ahead of forward by the
        pipeline (embedding lookup pipelines); usable on the current stream."""


class ContextSlot:
    """Holds the context of the batch whose forward is running (None between forwards), and counts
    the calls of each pipelined module in that forward.

    Contract for the pipeline: set `current` before the model's forward (that starts the count) and
    back to None after it; once forward returned, call `check_calls()` before using its output.
    """

    __slots__ = ("_calls", "_current", "_keys", "_taken", "_total")

    def __init__(self) -> None:
        self._current: ForwardContext | None = None
        self._keys: dict[str, tuple[str, ...]] = {}
        self._calls: dict[str, int] = {}
        self._taken = 0
        self._total = 0

    @property
    def current(self) -> ForwardContext | None:
        return self._current

    @current.setter
    def current(self, ctx: ForwardContext | None) -> None:
        if ctx is not None:  # a new forward: its calls are counted from zero
            self._calls.clear()
            self._taken = 0
        self._current = ctx

    def expect(self, fqn: str, keys: tuple[str, ...]) -> None:
        """Module `fqn` is called once per key in each forward (`rewrite_model` registers it)."""
        self.forget(fqn)
        self._keys[fqn] = keys
        self._total += len(keys)

    def forget(self, fqn: str) -> None:
        """Module `fqn` is no longer pipelined (`Rewrite.restore`)."""
        self._total -= len(self._keys.pop(fqn, ()))

    def take(self, fqn: str, take: str, what: str) -> Any:
        """What the current context prepared for this call of module `fqn`: counts the call, and
        hands over what its `take` method (`take_input_dist`, `take_prefetched`, `take_lookup`)
        returns under this call's site key.

        Raises:
            NotPreparedError: no context is current, or it has nothing under the key.
            CallCountError: `fqn` was already called once per call site in this forward.
        """
        ctx = self._current
        if ctx is None:
            raise _not_prepared(fqn, what)
        keys = self._keys[fqn]
        index = self._calls.get(fqn, 0)
        if index >= len(keys):
            raise CallCountError(
                f"{what} of sharded module {fqn!r} is not prepared for its call number {index + 1} "
                f"in this forward: the rewrite found {len(keys)} call site(s) for it, so only "
                f"{len(keys)} input(s) were prepared. Either the model was called again with the "
                "same context (call pipeline.detach() to run it outside the pipeline), or the "
                "number of calls of the module changed between batches, which a pipelined module "
                "must not do."
            )
        self._calls[fqn] = index + 1
        self._taken += 1
        prepared = getattr(ctx, take)(keys[index])
        if prepared is None:
            raise _not_prepared(keys[index], what)
        return prepared

    def check_calls(self) -> None:
        """Check that the last forward called every pipelined module once per call site.

        Raises:
            CallCountError: a module was called fewer times than it has call sites: its calls may
                have taken inputs prepared for other calls, so the forward's output is not to be
                used.
        """
        if self._taken == self._total:
            return
        short = [
            f"{fqn!r}: {self._calls.get(fqn, 0)} call(s) for {len(keys)} call site(s)"
            for fqn, keys in self._keys.items()
            if self._calls.get(fqn, 0) < len(keys)
        ]
        raise CallCountError(
            "the forward called pipelined sharded modules fewer times than the rewrite found call "
            f"sites for them ({'; '.join(short)}); a call may have taken the input prepared for "
            "another call, so this forward's output is not used. The number of calls of a "
            "pipelined module must not change between batches."
        )


def _not_prepared(key: str, what: str) -> NotPreparedError:
    return NotPreparedError(
        f"{what} of sharded module call site {key!r} is not prepared for this call. Either the "
        "model was called directly while a pipeline is attached to it, or the pipeline did not "
        "prepare this call site. To run the model outside the pipeline, call pipeline.detach() "
        "first (the next progress() re-attaches)."
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
        module_ctx, dist_input = self.slot.take(self.fqn, self._take, self._what)
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
        return self.slot.take(self.fqn, "take_lookup", "The embedding lookup")


class PostprocForward(_HijackedForward):
    """Returns the postproc output computed ahead with input_dist instead of recomputing it."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ctx = self.slot.current
        result = None if ctx is None else ctx.postproc_result(self.fqn)
        if result is None:
            raise _not_prepared(self.fqn, "The output of postproc module")
        return result
