"""`LookupStage`: a batch's embedding lookup run ahead of its forward (Fused, PEC, SemiSync), the
output all-to-all of each module's `compute_and_output_dist` left in flight for forward."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pipeline.stages.context import BatchContext, LookupBatchContext
from pipeline.stages.input_dist import InputDist
from pipeline.stages.streams import Streams, run_stage

__all__ = ["LookupStage"]


class LookupStage:
    """Runs the lookup stage of a batch, ordered after the embedding update it must see. `optimizer`:
    the dense optimizer (whether it steps a pipelined module's parameters); `on_caller_stream`: run on
    the caller's stream, not data_dist; `forward_only`: never record gradients (eval pipelines)."""

    def __init__(
        self,
        streams: Streams,
        input_dist: InputDist,
        model: nn.Module,
        optimizer: Any,
        *,
        on_caller_stream: bool = False,
        forward_only: bool = False,
    ) -> None:
        self._streams, self._input_dist, self._model, self._optimizer = streams, input_dist, model, optimizer
        self._stream = None if on_caller_stream else streams.data_dist
        self._forward_only = forward_only
        self._dense_in_sparse: bool | None = None

    def run(self, ctx: BatchContext) -> None:
        """The lookup stage of `ctx` (a no-op once done, or before its input_dist started)."""
        assert isinstance(ctx, LookupBatchContext)
        input_dist = self._input_dist
        if ctx.looked_up or not ctx.started or input_dist.rewrite is None:
            return
        input_dist.wait_splits(ctx)
        input_dist.release_inputs(ctx)
        streams = self._streams
        with (
            run_stage(streams, "lookup", ctx.index, self._stream),
            torch.set_grad_enabled(self._model.training and not self._forward_only),
        ):
            for site in input_dist.sites:
                prepared = ctx.take_input_dist(site.key)
                if prepared is None:
                    continue
                module_ctx, data = prepared
                output = site.module.compute_and_output_dist(module_ctx, data)
                streams.produced(output)
                ctx.lookups[site.key] = (module_ctx, data, output)
        ctx.looked_up = True

    def shares_optimizer(self) -> bool:
        """Whether a pipelined module has parameters in the dense optimizer (known after attach)."""
        if self._dense_in_sparse is None and self._input_dist.rewrite is not None:
            dense = {id(p) for group in self._optimizer.param_groups for p in group["params"]}
            self._dense_in_sparse = any(
                id(p) in dense for pm in self._input_dist.modules for p in pm.module.parameters()
            )
        return bool(self._dense_in_sparse)

    def backward_and_step(
        self, losses: Any, backward: Callable[[Any], None], step: Callable[[], None]
    ) -> None:
        """`backward(losses)`, then `step()`; the next lookup is ordered after backward (the fused
        embedding update), or after the step where the dense optimizer also updates a pipelined module."""
        backward(losses)
        if not self.shares_optimizer():
            self._fence()
        step()
        if self.shares_optimizer():
            self._fence()

    def wait(self) -> None:
        """Order the caller's stream after every lookup run so far."""
        self._streams.handoff(None, self._stream)

    def _fence(self) -> None:
        """Order the data_dist stream after the caller's work."""
        streams = self._streams
        caller = streams.current()
        with streams.use(streams.data_dist):
            streams.handoff(None, caller)
