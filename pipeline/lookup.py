"""Pipelines that run the embedding lookup ahead of forward: TrainPipelineFusedSparseDist here,
TrainPipelineSemiSync in `pipeline.semi_sync`.

Both add a `lookup` stage to TrainPipelineSparseDist: for each pipelined module it waits for the
input_dist result and runs `compute_and_output_dist` (local lookup, then the pooled-embedding
all-to-all, left in flight); forward then takes that output (`rewrite.LookupPipelinedForward`)
instead of running the lookup itself. They differ in when the lookup of a batch runs:

| pipeline  | lookup of batch i runs                                  | numerics                  |
|-----------|---------------------------------------------------------|---------------------------|
| Fused     | at the start of step i, after backward of i-1           | the plain loop's          |
| SemiSync  | in step i-1, between forward and backward of i-1 (*)   | embeddings one step stale |

(*) for i > `start_batch`; before that, at the end of step i-1, after its optimizer step.

The embedding optimizer is fused into backward (torchrec's fused kernels), so the tables batch i
reads are final once backward of i-1 is done. On CUDA the lookup runs on the data_dist stream, which
waits for the caller's stream after backward (after the optimizer step when a pipelined module has
parameters in the dense optimizer, such as position weights), so it overlaps the dense optimizer
step there. On CPU every stage runs on the calling thread in the order above: what overlaps is the
pooled-embedding all-to-all (gloo's threads) with whatever runs before forward needs it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pipeline.base import _Lane
from pipeline.context import BatchContext, LookupBatchContext
from pipeline.labels import stage
from pipeline.sparse_dist import TrainPipelineSparseDist

__all__ = ["TrainPipelineFusedSparseDist"]


class _LookupPipeline(TrainPipelineSparseDist):
    """SparseDist with a lookup stage (`_lookup`) and forwards that take its output."""

    _context_type = LookupBatchContext

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rewrite_options["lookup"] = True
        self._dense_in_sparse: bool | None = None
        """Some pipelined module has parameters the dense optimizer steps (known after attach)."""
        self._lookup_stream = self._streams.data_dist
        """Where the lookup stage runs (None: the caller's stream)."""

    def _lookup(self, ctx: BatchContext) -> None:
        """The lookup stage of `ctx`: wait for its input_dist, run `compute_and_output_dist`."""
        assert isinstance(ctx, LookupBatchContext)
        if ctx.looked_up or not ctx.started or self._rewrite is None:
            return
        self._wait_splits(ctx)  # a no-op unless the splits are still in flight
        streams = self._streams
        with (
            stage(streams, "lookup", ctx.index, self._lookup_stream),
            torch.set_grad_enabled(self._model.training and self._trains),
        ):
            for pm in self._rewrite.modules:
                prepared = ctx.take_input_dist(pm.fqn)
                if prepared is None:
                    continue
                module_ctx, data = prepared
                output = pm.module.compute_and_output_dist(module_ctx, data)
                streams.produced(output)
                ctx.lookups[pm.fqn] = (module_ctx, data, output)
        ctx.looked_up = True

    def _shares_optimizer(self) -> bool:
        """Whether a pipelined module has parameters in the dense optimizer."""
        if self._dense_in_sparse is None and self._rewrite is not None:
            dense = {id(p) for group in self._optimizer.param_groups for p in group["params"]}
            self._dense_in_sparse = any(
                id(p) in dense for pm in self._rewrite.modules for p in pm.module.parameters()
            )
        return bool(self._dense_in_sparse)

    def _fence(self) -> None:
        """Order the data_dist stream (where lookups run) after the caller's work so far."""
        streams = self._streams
        caller = streams.current()
        with streams.use(streams.data_dist):
            streams.handoff(None, caller)

    def _backward_and_step(self, ctx: BatchContext, losses: Any) -> None:
        with stage(self._streams, "backward", ctx.index):
            torch.sum(losses).backward()
        if not self._shares_optimizer():
            self._fence()  # the fused embedding update is done: the next lookup may start
        with stage(self._streams, "optimizer", ctx.index):
            self._optimizer_step(ctx)
        if self._shares_optimizer():
            self._fence()

    def _optimizer_step(self, ctx: BatchContext) -> None:
        self._optimizer.step()


class TrainPipelineFusedSparseDist(_LookupPipeline):
    """SparseDist whose embedding lookup of batch i runs at the start of step i, ahead of forward.

    Per `progress()` call that returns batch i: lookup of i (data_dist stream), input_dist of i+1,
    copy of i+2, forward of i (which takes the lookup's output), backward, optimizer step. On CUDA
    the lookup of batch i overlaps the dense optimizer step of batch i-1, as in torchrec 1.8; on CPU
    its pooled-embedding all-to-all overlaps the input_dist start of i+1, the copy of i+2 and the
    part of forward before the embeddings are used.

    Numerics: bit for bit the plain loop's (zero_grad, forward, backward, step per batch), for
    fused embedding optimizers. Where a sharded module has parameters in the dense optimizer
    (feature processors), the lookup waits for the optimizer step, so the numerics stay exact
    (torchrec's class does not wait and warns that this case is not exact).

    Args:
        model, optimizer, device, execute_all_batches, apply_jit, pipeline_postproc,
            custom_model_fwd: as `TrainPipelineSparseDist` (torchrec's positional order).
        strict: fail on the first batch if any sharded module cannot be pipelined.
        emb_lookup_stream: "data_dist" (default) or "new": the lookup runs on the data_dist
            stream; "current": on the caller's stream.
        embedding_lookup_after_data_dist: run the lookup of i after starting input_dist of i+1
            (and copying i+2) instead of first.
        enable_inplace_copy_batch, enqueue_batch_after_forward, free_features_storage_early,
            clear_data_dist_inputs: torchrec's memory/ordering options; accepted and ignored.
        **options: the keyword options of `TrainPipelineSparseDist` (`input_dist_schedule`,
            `arg_paths`, `streams`, `on_uneven`, ...).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        pipeline_postproc: bool = True,
        custom_model_fwd: Callable[[Any], Any] | None = None,
        strict: bool = False,
        emb_lookup_stream: str = "data_dist",
        embedding_lookup_after_data_dist: bool = False,
        enable_inplace_copy_batch: bool = False,
        enqueue_batch_after_forward: bool = False,
        free_features_storage_early: bool = False,
        clear_data_dist_inputs: bool = False,
        **options: Any,
    ) -> None:
        if emb_lookup_stream not in ("data_dist", "new", "current"):
            raise ValueError(
                f'emb_lookup_stream must be "data_dist", "new" or "current"; got {emb_lookup_stream!r}'
            )
        super().__init__(
            model,
            optimizer,
            device,
            execute_all_batches,
            apply_jit,
            None,
            pipeline_postproc,
            custom_model_fwd,
            strict=strict,
            **options,
        )
        self._lookup_first = not embedding_lookup_after_data_dist
        if emb_lookup_stream == "current":
            self._lookup_stream = None

    def _step(self, lane: _Lane) -> Any:
        if self._lookup_first:
            self._lookup(lane.inflight[0])
        return super()._step(lane)

    def _before_forward(self, ctx: BatchContext) -> None:
        self._lookup(ctx)  # a no-op when it ran first
