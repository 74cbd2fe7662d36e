"""TrainPipelineSparseDistOptStash: SparseDist whose optimizer state leaves device memory between
steps (`pipeline.stages.stash`): copied to host memory and freed after each optimizer step, given
back from an injection site in backward (a sharded module's output all-to-all), so that on a GPU
the copy back overlaps the rest of backward. Per step of batch i: as SparseDist's, with the restore
started at the site, the optimizer step after it (if the site was not reached, the restore runs
there: always on one rank, whose output all-to-all is no collective), then the stash.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
from torchrec.distributed.types import ShardingType

from pipeline.compat.backward_injection import InjectionSite, OutputDistTensorFinder, hook_backward
from pipeline.config import InputDistOptions, RankOptions, RewriteOptions
from pipeline.pipelines.sparse_dist import TrainPipelineSparseDist
from pipeline.ranks import Lane
from pipeline.stages.context import BatchContext, TrainPipelineContext
from pipeline.stages.stash import Stash, tensors_in
from pipeline.stages.streams import Streams
from rewrite import unwrap_model

__all__ = ["TrainPipelineSparseDistOptStash"]


class TrainPipelineSparseDistOptStash(TrainPipelineSparseDist):
    """SparseDist whose optimizer state is in host memory between optimizer steps.

    Numerics: the plain loop's, bit for bit (the state comes back byte for byte before each
    step). The state tensors keep their identity: between two `progress()` calls they are empty
    (their storage freed), also after StopIteration; `detach()`, `drain()` and `reset()` give them
    back, so call one before saving the optimizer's state (torchrec redirects its checkpoint stager
    to the host copy instead). On a GPU the copies run on the memcpy stream (host memory pinned); on
    CPU the host copy is in the same memory, so nothing is saved there.

    Args (torchrec's, in its order; the rest, and our keyword-only ones, as in `TrainPipelineSparseDist`):
        site_fqn: the sharded module whose output all-to-all's backward starts the restore, as
            the user's model names it.
        sharding_type: which of its output all-to-alls (one per sharding type).
        stash_min_bytes (ours): state tensors smaller than this stay (torchrec's threshold, 1 MiB).

    The state of a fused embedding optimizer (ShardedTensors, which its kernel updates inside
    backward) is not stashed.
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
        """`TrainPipelineSparseDist.drain()`, with the optimizer state given back at the end (the
        state a checkpoint saves)."""
        outputs = super().drain(dataloader_iter)
        self._stash.ready()
        return outputs

    def _step(self, lane: Lane) -> Any:
        ctx = lane.inflight[0]
        input_dist = self._input_dist
        input_dist.choose_schedule(self._model.training)
        input_dist.release_inputs(ctx)
        copy_late = self._enqueue_batch_after_forward
        if not copy_late and len(lane.inflight) < 3:
            self._enqueue(lane)
        nxt = input_dist.start_next(lane)
        self._wait_for_batch()
        self._armed = self._model.training  # the site's hook restores from here
        losses, output = self._forward(ctx, train=True, input_dist=input_dist)
        if copy_late and len(lane.inflight) < 3:
            self._enqueue(lane)
        if nxt is not None:
            input_dist.wait_splits(nxt)  # a no-op after early splits
        if losses is not None:
            self._backward_stage(ctx, losses)  # the site's hook starts the restore
            self._sync_replicas(ctx)
            self._stash.ready()  # the restore complete (started here if the site was not reached)
            self._optimizer_stage(ctx)
            self._stash.stash(self._state_tensors())
        self._armed = False
        lane.inflight.popleft()
        return output

    def _state_tensors(self) -> list[torch.Tensor]:
        """The optimizer's state tensors in the pipeline's device memory, of `stash_min_bytes` or more."""
        device, least = self._device, self._stash_min_bytes
        tensors = tensors_in(getattr(self._optimizer, "state", {}))
        return [t for t in tensors if t.device.type == device.type and t.numel() * t.element_size() >= least]

    def _give_back(self) -> None:
        """On reset (an error in a step, or an abandoned iterator): the state back, so that the
        optimizer can be used or saved."""
        self._armed = False
        self._stash.ready()
