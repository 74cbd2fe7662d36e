"""TrainPipelineSparseDistEmbStash: SparseDist whose marked embedding weights leave device memory
between their lookup in forward and their backward (`pipeline.stages.embedding_stash`), given back
from an injection site in backward (by default a dense module's parameter gradient) and in any
case before backward reaches the kernel. `pipeline.pipelines.prefetch_ems` adds a prefetch stage.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from pipeline.compat.backward_injection import (
    FirstGradTensorFinder,
    InjectionSite,
    InjectionTargetType,
    hook_backward,
)
from pipeline.config import InputDistOptions, RankOptions, RewriteOptions
from pipeline.pipelines.sparse_dist import TrainPipelineSparseDist
from pipeline.ranks import Lane
from pipeline.stages.context import BatchContext, TrainPipelineContext
from pipeline.stages.embedding_stash import EmbeddingStash
from pipeline.stages.streams import Streams
from rewrite import unwrap_model

__all__ = ["TrainPipelineSparseDistEmbStash", "hook_embedding_stash"]


def hook_embedding_stash(
    model: nn.Module,
    stash: EmbeddingStash,
    site: str | InjectionSite,
    *,
    delay: bool,
    stash_site_fqn: str | None,
) -> None:
    """Wire `stash` to `model`: the restore at `site` in backward; with `delay`, the pending
    stashes run at the forward of `stash_site_fqn`, or at `site` just before the restore
    (torchrec's order). A `site` given as a string is a PARAM_GRAD site on that module."""
    root = unwrap_model(model)
    if isinstance(site, str):
        site = InjectionSite(site, FirstGradTensorFinder(), InjectionTargetType.PARAM_GRAD)
    if delay and stash_site_fqn is not None:
        root.get_submodule(stash_site_fqn).register_forward_pre_hook(lambda module, args: stash.run_pending())
    elif delay:
        hook_backward(site, root, lambda grad: stash.run_pending(), active=lambda: stash.armed)
    hook_backward(site, root, lambda grad: stash.restore(), active=lambda: stash.armed)


class TrainPipelineSparseDistEmbStash(TrainPipelineSparseDist):
    """SparseDist whose embedding weights marked `stash_weights=True` (a table config's flag) are
    in host memory from their lookup until backward comes back to them.

    Numerics: the plain loop's, bit for bit (the weights come back byte for byte before their
    kernel's backward). On a GPU the copies run on the memcpy stream; on CPU the host copy is in
    the same memory, so nothing is saved there. Without a marked table nothing is stashed.

    Args (torchrec's, in its order; the rest, and our keyword-only ones, as in `TrainPipelineSparseDist`):
        site_fqn: where backward starts the restore: a module of the user's model (a
            post-accumulate-grad hook on its last trainable parameter, e.g. the over arch), or an
            `InjectionSite` (ours or torchrec's).
        delay_stash: stash at `stash_site_fqn`'s forward (or, without it, at the site in
            backward) instead of right after the lookup.
        stash_site_fqn: the module (run after the lookups) before whose forward delayed stashes run.

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
        rewrite_method: str | None = None,
        arg_paths: dict[str, Any] | None = None,
        input_dist: InputDistOptions | None = None,
        input_dist_schedule: str | None = None,
        narrow_ids: bool | None = None,
        streams: Streams | None = None,
        ranks: RankOptions | None = None,
        on_uneven: str | None = None,
        check_keys: bool | None = None,
        check_kjts: bool | None = None,
        agreement: bool | None = None,
        abort_on_error: bool | None = None,
        failure_grace: float | None = None,
        peer_timeout: timedelta | None = None,
    ) -> None:
        self._build(locals())
        self._emb_stash = EmbeddingStash(self._streams, model, device, delay=delay_stash)
        self._on_reset.append(self._emb_stash.finish)
        hook_embedding_stash(
            model, self._emb_stash, site_fqn, delay=delay_stash, stash_site_fqn=stash_site_fqn
        )

    @property
    def stashed_bytes(self) -> int:
        """Bytes of embedding weights in host memory now (between a lookup and its restore)."""
        return self._emb_stash.lent_bytes

    def _step(self, lane: Lane) -> Any:
        ctx = lane.inflight[0]
        input_dist, emb_stash = self._input_dist, self._emb_stash
        input_dist.choose_schedule(self._model.training)
        input_dist.release_inputs(ctx)
        copy_late = self._enqueue_batch_after_forward
        if not copy_late and len(lane.inflight) < 3:
            self._enqueue(lane)
        nxt = input_dist.start_next(lane)
        self._wait_for_batch()
        if self._model.training:
            emb_stash.arm()  # the lookups of this forward lend their weights out
        losses, output = self._forward(ctx, train=True, input_dist=input_dist)
        if copy_late and len(lane.inflight) < 3:
            self._enqueue(lane)
        if nxt is not None:
            input_dist.wait_splits(nxt)  # a no-op after early splits
        if losses is not None:
            self._backward_stage(ctx, losses)  # the site, then each kernel's backward, restore
            self._sync_replicas(ctx)
        emb_stash.finish()
        if losses is not None:
            self._optimizer_stage(ctx)
        lane.inflight.popleft()
        return output
