"""torchrec's experimental pipelines that act from an injection site in backward, on SparseDist's step
(docs/reference.md, "Backward injection: BwdOpt, OptStash, EmbStash, PrefetchEMS")."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from enum import Enum
from functools import partial
from typing import Any

import torch
from torch import nn
from torchrec.distributed.types import ShardingType

from pipeline.compat.backward_injection import (
    FirstGradTensorFinder,
    InjectionSite,
    InjectionTargetType,
    OutputDistTensorFinder,
    hook_backward,
    will_hook_fire,
)
from pipeline.options import InputDistOptions, RankOptions, RewriteOptions
from pipeline.pipelines.sparse_dist import TrainPipelineSparseDist
from pipeline.stages.context import BatchContext, PrefetchBatchContext, TrainPipelineContext
from pipeline.stages.prefetch import PrefetchStage
from pipeline.stages.stash import EmbeddingStash, Stash, tensors_in
from pipeline.stages.streams import Streams, streams_for
from rewrite import unwrap_model

__all__ = [
    "StepInBackward",
    "StepPlacement",
    "TrainPipelinePrefetchEMS",
    "TrainPipelineSparseDistBwdOpt",
    "TrainPipelineSparseDistEmbStash",
    "TrainPipelineSparseDistOptStash",
    "hook_embedding_stash",
]


class TrainPipelineSparseDistBwdOpt(TrainPipelineSparseDist):
    """SparseDist whose optimizer stage runs inside backward, from the output all-to-all of `site_fqn`,
    once every gradient it applies is final (`StepInBackward`): the plain loop's numbers, bit for bit.
    `step_placement` says where it ran; under DDP (a DistributedModelParallel's dense part, by default)
    that is the end of backward, and nothing overlaps.

    Args (torchrec's, in its order; the others, and ours, keyword-only, as in `TrainPipelineSparseDist`):
        site_fqn: the sharded module whose output all-to-all's backward is the injection site.
        sharding_type: which of its output all-to-alls (one per sharding type).

    Raises:
        ValueError: `site_fqn` is not a module of the model.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        site_fqn: str,
        sharding_type: ShardingType = ShardingType.TABLE_WISE,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        context_type: type[BatchContext] = TrainPipelineContext,
        pipeline_postproc: bool = False,
        custom_model_fwd: Callable[[Any], tuple[torch.Tensor, Any]] | None = None,
        dmp_collection_sync_interval_batches: int | None = 1,
        enqueue_batch_after_forward: bool = False,
        enable_inplace_copy_batch: bool = False,
        free_features_storage_early: bool = False,
        clear_data_dist_inputs: bool = False,
        *,
        strict: bool = False,
        rewrite: RewriteOptions | None = None,
        input_dist: InputDistOptions | None = None,
        ranks: RankOptions | None = None,
        streams: Streams | None = None,
    ) -> None:
        self._setup(
            model,
            optimizer,
            device,
            execute_all_batches=execute_all_batches,
            apply_jit=apply_jit,
            pipeline_postproc=pipeline_postproc,
            custom_model_fwd=custom_model_fwd,
            dmp_collection_sync_interval_batches=dmp_collection_sync_interval_batches,
            enqueue_batch_after_forward=enqueue_batch_after_forward,
            enable_inplace_copy_batch=enable_inplace_copy_batch,
            free_features_storage_early=free_features_storage_early,
            clear_data_dist_inputs=clear_data_dist_inputs,
            strict=strict,
            rewrite=rewrite,
            input_dist=input_dist,
            ranks=ranks,
            streams=streams,
        )
        in_backward = self._in_backward = StepInBackward(model, optimizer, self._step_head)
        self._on_reset.append(in_backward.disarm)
        site = InjectionSite(site_fqn, OutputDistTensorFinder(sharding_type), InjectionTargetType.ACTIVATION)
        hook_backward(
            site, unwrap_model(model), lambda grad: in_backward.at_site(), active=lambda: in_backward.armed
        )
        self._noted: set[StepPlacement] = set()

    @property
    def step_placement(self) -> StepPlacement | None:
        """Where the optimizer stage of the last training step ran (None before the first)."""
        return self._in_backward.placement

    def _before_forward(self, ctx: BatchContext, nxt: BatchContext | None) -> None:
        if self._model.training:
            self._in_backward.arm()

    def _after_forward(self, ctx: BatchContext, nxt: BatchContext | None, losses: Any) -> None:
        if losses is None:
            self._in_backward.disarm()

    def _backward_and_optimizer(self, ctx: BatchContext, losses: Any) -> None:
        self._backward_stage(ctx, losses)  # the optimizer stage runs inside, from its hooks
        self._sync_replicas(ctx)
        self._note(self._in_backward.finish())  # or here

    def _step_head(self) -> None:
        """The optimizer stage of the batch in backward, the lane's head."""
        self._optimizer_stage(self._lane.inflight[0])

    def _note(self, placement: StepPlacement) -> None:
        report = self._input_dist.report
        if placement in self._noted or placement is StepPlacement.AT_SITE or report is None:
            return
        self._noted.add(placement)
        report.notes.append(f"TrainPipelineSparseDistBwdOpt: the optimizer step ran {placement.value}")


class StepPlacement(Enum):
    """Where `StepInBackward` ran the optimizer stage of a step."""

    AT_SITE = "at the injection site"
    AT_LAST_GRADIENT = "at the last dense gradient, after the injection site"
    AT_END_OF_BACKWARD = "at the end of backward, after DDP's all-reduce of the gradients"
    AFTER_BACKWARD = "after backward (the injection site was not reached, or a gradient never came)"


def _reduced_by_ddp(model: nn.Module) -> set[int]:
    """Ids of the parameters whose gradients a DistributedDataParallel inside `model` all-reduces."""
    reduced: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.parallel.DistributedDataParallel):
            ignored = getattr(module, "parameters_to_ignore", set())
            reduced |= {id(p) for n, p in module.module.named_parameters() if n not in ignored}
    return reduced


class StepInBackward:
    """Runs `step` inside backward once the injection site is reached and every gradient it applies is
    final: without DDP, once the post-accumulate-grad hook of each of `optimizer`'s parameters fired
    after the site; where DDP reduces some, at backward's end, after its all-reduce; else at `finish()`."""

    def __init__(self, model: nn.Module, optimizer: Any, step: Callable[[], None]) -> None:
        self._step = step
        params = [p for group in optimizer.param_groups for p in group["params"] if will_hook_fire(p)]
        reduced = _reduced_by_ddp(model)
        self._awaited = frozenset(id(p) for p in params)
        self._at_end = any(id(p) in reduced for p in params)
        self._pending: set[int] = set()
        self.armed = False
        """Between `arm()` and `finish()`: the hooks act (not in a user's own backward)."""
        self._site_reached = False
        self._queued = False
        self.placement: StepPlacement | None = None
        """Where the last step ran (None before the first, or while it has not run)."""
        for p in params:
            p.register_post_accumulate_grad_hook(self._accumulated)

    def arm(self) -> None:
        """Before a training batch's forward."""
        self.armed, self._site_reached, self._queued = True, False, False
        self._pending = set(self._awaited)
        self.placement = None

    def at_site(self) -> None:
        """The injection site's hook: backward reached it."""
        if self.armed and not self._site_reached:
            self._site_reached = True
            self._try(StepPlacement.AT_SITE)

    def finish(self) -> StepPlacement:
        """After backward: the step, if backward did not run it. Returns where it ran."""
        if self.placement is None:
            self._run(StepPlacement.AFTER_BACKWARD)
        self.armed = False
        assert self.placement is not None
        return self.placement

    def disarm(self) -> None:
        """The step ended abnormally (the pipeline reset): nothing runs until the next `arm()`."""
        self.armed = False

    def _accumulated(self, p: torch.Tensor) -> None:
        if self.armed:
            self._pending.discard(id(p))
            if self._site_reached:
                self._try(StepPlacement.AT_LAST_GRADIENT)

    def _try(self, placement: StepPlacement) -> None:
        if self.placement is not None or self._queued:
            return
        if self._at_end:
            # DDP queues its reducer's finish as an engine callback, maybe after this point: a
            # callback queued by a callback runs after all of those
            self._queued = True
            engine = torch.autograd.Variable._execution_engine
            at_end = partial(self._run, StepPlacement.AT_END_OF_BACKWARD)
            engine.queue_callback(lambda: engine.queue_callback(at_end))
        elif not self._pending:
            self._run(placement)

    def _run(self, placement: StepPlacement) -> None:
        if self.placement is None and self.armed:
            self.placement = placement
            self._step()


class TrainPipelineSparseDistOptStash(TrainPipelineSparseDist):
    """SparseDist whose dense optimizer state is in host memory between optimizer steps, given back from
    an injection site in backward: the plain loop's numbers. Between two `progress()` calls the state
    tensors are empty: call `detach()`, `drain()` or `reset()` before saving the optimizer's state.

    Args (torchrec's, in its order; the others, and ours, keyword-only, as in `TrainPipelineSparseDist`):
        site_fqn: the sharded module whose output all-to-all's backward starts the restore.
        sharding_type: which of its output all-to-alls (one per sharding type).
        stash_min_bytes (ours): state tensors smaller than this stay (torchrec's threshold, 1 MiB).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        site_fqn: str,
        sharding_type: ShardingType = ShardingType.TABLE_WISE,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        context_type: type[BatchContext] = TrainPipelineContext,
        pipeline_postproc: bool = False,
        custom_model_fwd: Callable[[Any], tuple[torch.Tensor, Any]] | None = None,
        dmp_collection_sync_interval_batches: int | None = 1,
        enqueue_batch_after_forward: bool = False,
        enable_inplace_copy_batch: bool = False,
        free_features_storage_early: bool = False,
        clear_data_dist_inputs: bool = False,
        *,
        stash_min_bytes: int = 1 << 20,
        strict: bool = False,
        rewrite: RewriteOptions | None = None,
        input_dist: InputDistOptions | None = None,
        ranks: RankOptions | None = None,
        streams: Streams | None = None,
    ) -> None:
        self._setup(
            model,
            optimizer,
            device,
            execute_all_batches=execute_all_batches,
            apply_jit=apply_jit,
            pipeline_postproc=pipeline_postproc,
            custom_model_fwd=custom_model_fwd,
            dmp_collection_sync_interval_batches=dmp_collection_sync_interval_batches,
            enqueue_batch_after_forward=enqueue_batch_after_forward,
            enable_inplace_copy_batch=enable_inplace_copy_batch,
            free_features_storage_early=free_features_storage_early,
            clear_data_dist_inputs=clear_data_dist_inputs,
            strict=strict,
            rewrite=rewrite,
            input_dist=input_dist,
            ranks=ranks,
            streams=streams,
        )
        self._stash = Stash(self._streams, "optimizer_state")
        self._stash_min_bytes = stash_min_bytes
        self._armed = False
        self._on_reset.append(self._give_back)
        site = InjectionSite(site_fqn, OutputDistTensorFinder(sharding_type))
        hook_backward(
            site, unwrap_model(model), lambda grad: self._stash.restore(), active=lambda: self._armed
        )

    @property
    def stashed_bytes(self) -> int:
        """Bytes of optimizer state in host memory now (freed from the device)."""
        return self._stash.lent_bytes

    def detach(self) -> torch.nn.Module:
        """`TrainPipelineSparseDist.detach()`, with the optimizer state given back first."""
        self._stash.ready()
        return super().detach()

    def drain(self, dataloader_iter: Iterator[Any]) -> list[Any]:
        """`TrainPipelineSparseDist.drain()`, with the optimizer state given back at the end."""
        outputs = super().drain(dataloader_iter)
        self._stash.ready()
        return outputs

    def _before_forward(self, ctx: BatchContext, nxt: BatchContext | None) -> None:
        self._armed = self._model.training

    def _backward_and_optimizer(self, ctx: BatchContext, losses: Any) -> None:
        self._backward_stage(ctx, losses)  # the site's hook starts the restore
        self._sync_replicas(ctx)
        self._stash.ready()  # the restore complete (started here if the site was not reached)
        self._optimizer_stage(ctx)
        self._stash.stash(self._state_tensors())
        self._armed = False

    def _state_tensors(self) -> list[torch.Tensor]:
        """The optimizer's state tensors on the pipeline's device, of `stash_min_bytes` or more."""
        device, least = self._device, self._stash_min_bytes
        tensors = tensors_in(getattr(self._optimizer, "state", {}))
        return [t for t in tensors if t.device.type == device.type and t.numel() * t.element_size() >= least]

    def _give_back(self) -> None:
        """On reset (an error in a step, an abandoned iterator): the state back, usable and savable."""
        self._armed = False
        self._stash.ready()


def hook_embedding_stash(
    model: nn.Module,
    stash: EmbeddingStash,
    site: str | InjectionSite,
    *,
    delay: bool,
    stash_site_fqn: str | None,
) -> None:
    """Wire `stash` to `model`: the restore at `site` in backward; with `delay`, the pending stashes
    at the forward of `stash_site_fqn`, or else at `site` just before the restore (torchrec's order)."""
    root = unwrap_model(model)
    if isinstance(site, str):
        site = InjectionSite(site, FirstGradTensorFinder(), InjectionTargetType.PARAM_GRAD)
    if delay and stash_site_fqn is not None:
        root.get_submodule(stash_site_fqn).register_forward_pre_hook(lambda module, args: stash.run_pending())
    elif delay:
        hook_backward(site, root, lambda grad: stash.run_pending(), active=lambda: stash.armed)
    hook_backward(site, root, lambda grad: stash.restore(), active=lambda: stash.armed)


class TrainPipelineSparseDistEmbStash(TrainPipelineSparseDist):
    """SparseDist whose embedding weights marked `stash_weights=True` (a table config's flag) are in
    host memory from their lookup until backward comes back to them: the plain loop's numbers.

    Args (torchrec's, in its order; the others, and ours, keyword-only, as in `TrainPipelineSparseDist`):
        site_fqn: where backward starts the restore: a module (a hook on its last trainable parameter's
            gradient, e.g. the over arch), or an `InjectionSite`.
        delay_stash: stash at `stash_site_fqn`'s forward (without one, at the site) instead of at once.
        stash_site_fqn: the module, run after the lookups, before whose forward delayed stashes run.

    Raises:
        ValueError: `site_fqn` (or `stash_site_fqn`) is not a module of the model.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        site_fqn: str | InjectionSite,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        context_type: type[BatchContext] = TrainPipelineContext,
        pipeline_postproc: bool = False,
        custom_model_fwd: Callable[[Any], tuple[torch.Tensor, Any]] | None = None,
        dmp_collection_sync_interval_batches: int | None = 1,
        enqueue_batch_after_forward: bool = False,
        enable_inplace_copy_batch: bool = False,
        free_features_storage_early: bool = False,
        delay_stash: bool = False,
        stash_site_fqn: str | None = None,
        clear_data_dist_inputs: bool = False,
        *,
        strict: bool = False,
        rewrite: RewriteOptions | None = None,
        input_dist: InputDistOptions | None = None,
        ranks: RankOptions | None = None,
        streams: Streams | None = None,
    ) -> None:
        self._setup(
            model,
            optimizer,
            device,
            execute_all_batches=execute_all_batches,
            apply_jit=apply_jit,
            pipeline_postproc=pipeline_postproc,
            custom_model_fwd=custom_model_fwd,
            dmp_collection_sync_interval_batches=dmp_collection_sync_interval_batches,
            enqueue_batch_after_forward=enqueue_batch_after_forward,
            enable_inplace_copy_batch=enable_inplace_copy_batch,
            free_features_storage_early=free_features_storage_early,
            clear_data_dist_inputs=clear_data_dist_inputs,
            strict=strict,
            rewrite=rewrite,
            input_dist=input_dist,
            ranks=ranks,
            streams=streams,
        )
        self._emb_stash = EmbeddingStash(self._streams, model, device, delay=delay_stash)
        self._on_reset.append(self._emb_stash.finish)
        hook_embedding_stash(
            model, self._emb_stash, site_fqn, delay=delay_stash, stash_site_fqn=stash_site_fqn
        )

    @property
    def stashed_bytes(self) -> int:
        """Bytes of embedding weights in host memory now (between a lookup and its restore)."""
        return self._emb_stash.lent_bytes

    def _before_forward(self, ctx: BatchContext, nxt: BatchContext | None) -> None:
        if self._model.training:
            self._emb_stash.arm()

    def _backward_and_optimizer(self, ctx: BatchContext, losses: Any) -> None:
        self._backward_stage(ctx, losses)  # the site, then each kernel's backward, restores
        self._sync_replicas(ctx)
        self._emb_stash.finish()
        self._optimizer_stage(ctx)


class TrainPipelinePrefetchEMS(TrainPipelineSparseDistEmbStash):
    """EmbStash plus a prefetch stage: after forward of batch i the weights come back and the prefetch
    of batch i+1 is submitted, before backward of i; the plain loop's numbers. Args: as
    `TrainPipelineSparseDistEmbStash`'s (`streams` None: on CPU a prefetch worker thread)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        site_fqn: str | InjectionSite,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        context_type: type[BatchContext] = TrainPipelineContext,
        pipeline_postproc: bool = False,
        custom_model_fwd: Callable[[Any], tuple[torch.Tensor, Any]] | None = None,
        dmp_collection_sync_interval_batches: int | None = 1,
        enqueue_batch_after_forward: bool = False,
        enable_inplace_copy_batch: bool = False,
        free_features_storage_early: bool = False,
        *,
        strict: bool = False,
        rewrite: RewriteOptions | None = None,
        input_dist: InputDistOptions | None = None,
        ranks: RankOptions | None = None,
        streams: Streams | None = None,
    ) -> None:
        self._setup(
            model,
            optimizer,
            device,
            execute_all_batches=execute_all_batches,
            apply_jit=apply_jit,
            pipeline_postproc=pipeline_postproc,
            custom_model_fwd=custom_model_fwd,
            dmp_collection_sync_interval_batches=dmp_collection_sync_interval_batches,
            enqueue_batch_after_forward=enqueue_batch_after_forward,
            enable_inplace_copy_batch=enable_inplace_copy_batch,
            free_features_storage_early=free_features_storage_early,
            strict=strict,
            rewrite=rewrite,
            input_dist=input_dist,
            ranks=ranks,
            streams=streams if streams is not None else streams_for(device, prefetch_thread=True),
            forward="prefetch",
            context_type=PrefetchBatchContext,
        )
        self._prefetch = PrefetchStage(self._streams, self._input_dist, ahead="auto")
        self._emb_stash = EmbeddingStash(self._streams, model, device, delay=False)
        self._on_reset.append(self._emb_stash.finish)
        hook_embedding_stash(model, self._emb_stash, site_fqn, delay=False, stash_site_fqn=None)

    def _before_forward(self, ctx: BatchContext, nxt: BatchContext | None) -> None:
        self._prefetch.wait(ctx)  # submitted in the step before (the first batch's: now)
        super()._before_forward(ctx, nxt)

    def _after_forward(self, ctx: BatchContext, nxt: BatchContext | None, losses: Any) -> None:
        self._emb_stash.ready()  # before backward, and before the prefetch of i+1 touches the kernels
        if nxt is not None:
            self._prefetch.submit(nxt)
