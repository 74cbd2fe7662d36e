"""EvalPipelineCPUSparse: forward only, for embedding tables on the host and a dense part on a device;
the sparse stage of a later batch (input_dist, lookup and output all-to-all, on the host) runs while
the device computes (stages and streams: `pipeline.stages`).

Three stages per batch, as in torchrec's class: sparse (on the host: the batch's input_dist, its
lookup, the outputs waited for), copy (the batch and the looked-up embeddings to the device, on the
memcpy stream), dense forward (the sharded modules return the copied embeddings). With
`pipeline_depth=2`, step i runs forward of i, the copy of i+1 and the sparse stage of i+2; with 1,
forward of i and the sparse stage and copy of i+1. On a CPU-only machine the device is the host:
the copy moves nothing, and the sparse stage overlaps forward only on the worker (`multi_thread`).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeline.config import InputDistOptions, RankOptions, RewriteOptions
from pipeline.pipelines.sparse_dist import TrainPipelineSparseDist
from pipeline.ranks import Lane
from pipeline.stages.context import HostLookupBatchContext
from pipeline.stages.copy import to_device, to_device_in_place
from pipeline.stages.lookup import LookupStage
from pipeline.stages.streams import Streams, run_stage
from pipeline.stages.thread_streams import streams_for

__all__ = ["EvalPipelineCPUSparse"]


class EvalPipelineCPUSparse(TrainPipelineSparseDist):
    """Forward-only pipeline: the sparse stage of batch i+`pipeline_depth` on the host, the copy of
    i+1 and forward of i on the device.

    Numerics: each output is bit for bit the model's own output for that batch (`model(batch)`
    under `no_grad`, in the model's mode, which is left as it is); nothing is stepped.

    Args (torchrec's, in its order):
        model: sharded modules on the host (torchrec's class wants DATA_PARALLEL tables there;
            any sharding that runs on the host works here), the dense part on `device`.
        optimizer: not used.
        device: where the batch, the embeddings and the dense forward go.
        execute_all_batches: accepted; every batch runs (so does torchrec's class).
        apply_jit: not supported; must be False.
        pipeline_postproc, free_features_storage_early, clear_data_dist_inputs: as in
            `TrainPipelineSparseDist`.
        enable_inplace_copy_batch: allocate the device copies on the stream that uses them.
        multi_thread: run the sparse stage on a worker thread, so that it overlaps forward on
            the host too; only where it runs no collective (data-parallel tables, one rank),
            since a collective beside forward's would interleave differently on each rank.
            Otherwise it stays on the calling thread, and the rewrite report says so.
        pipeline_depth: 2 or 1 (batches whose sparse stage ran ahead of their forward).

    Keyword-only, ours: as in `TrainPipelineSparseDist`, less the input_dist schedule (each
    batch's is waited for at once); `streams`: the device's (the copy runs on its memcpy), None: a
    memcpy stream on a GPU, none on CPU. The sparse stage is on the host and uses none.
    """

    _status_rides_splits = False  # it admits batches itself

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        device: torch.device,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        pipeline_postproc: bool = False,
        enable_inplace_copy_batch: bool = False,
        multi_thread: bool = False,
        pipeline_depth: int = 2,
        free_features_storage_early: bool = False,
        clear_data_dist_inputs: bool = False,
        *,
        strict: bool = False,
        rewrite: RewriteOptions | None = None,
        rewrite_method: str | None = None,
        arg_paths: dict[str, Any] | None = None,
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
        if pipeline_depth not in (1, 2):
            raise ValueError(f"pipeline_depth must be 1 or 2; got {pipeline_depth!r}")
        self._build(
            locals(),
            device=torch.device("cpu"),  # fetched batches stay on the host, where the sparse stage reads them
            execute_all_batches=True,  # accepted; every batch runs
            enable_inplace_copy_batch=False,  # the dense copies' (`_in_place`), not the sparse stage's
            input_dist=InputDistOptions(schedule="late"),  # waited for at once: nothing to schedule
            streams=Streams(),  # the sparse stage's: the host has none
            forward="lookup",
            batch_context=HostLookupBatchContext,
            lookahead=0,
        )
        self._lookup = LookupStage(self._streams, self._input_dist, model, optimizer, forward_only=True)
        self._dense_device = device
        self._dense = streams if streams is not None else streams_for(device, data_dist=False)
        self._in_place = enable_inplace_copy_batch
        self._depth = pipeline_depth
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="pipeline-sparse") if multi_thread else None
        self._local: bool | None = None
        """The sparse stage runs no collective (known once a batch's input_dist started)."""
        self._job: Future | None = None
        """The sparse stage running on the worker (at most one)."""
        self._on_reset.append(lambda: self._wait_sparse(discard=True))
        self._on_reset.append(self._dense.discard)  # the dropped batches' copies

    def _fill(self, lane: Lane) -> None:
        """A lane's first batches: batch i through the sparse stage and the copy, and with depth
        2 batch i+1 through the sparse stage (later steps keep it so)."""
        if lane.inflight:
            return
        self._enqueue_sparse(lane, on_worker=False)
        if lane.inflight:
            self._to_device(lane.inflight[0])
        if self._depth == 2 and lane.inflight:
            self._enqueue_sparse(lane, on_worker=False)

    def _step(self, lane: Lane) -> Any:
        ctx = lane.inflight[0]
        self._to_device(ctx)  # a no-op unless its sparse stage ran on the worker (depth 1)
        self._wait_for_batch()
        _, output = self._forward(ctx, train=False, input_dist=self._input_dist)
        # forward only: its use of what memcpy copied is queued (the core releases the host's streams)
        self._dense.release(ctx)
        self._dense.returned(output)
        lane.inflight.popleft()
        if self._depth == 2 and lane.inflight:
            self._to_device(lane.inflight[0])  # batch i+1, whose sparse stage ran in step i-1
        self._enqueue_sparse(lane, on_worker=True)  # batch i+depth
        return output

    def _wait_for_batch(self) -> None:
        """Make the head batch and its embeddings, copied on the memcpy stream, usable on the
        caller's stream (torchrec's subclass point)."""
        ctx = self._ranks.lane.inflight[0]
        dense = self._dense
        for obj in (ctx.batch, *ctx.embeddings.values()):
            dense.handoff(obj, dense.memcpy, ctx)
            dense.consumed(obj)

    def detach(self) -> nn.Module:
        self._wait_sparse()  # the worker may be running a sharded module's input_dist
        return super().detach()

    def _enqueue_sparse(self, lane: Lane, *, on_worker: bool) -> None:
        """Fetch a batch and run its sparse stage (on the worker if `on_worker` and it may)."""
        if not self._enqueue(lane):
            return
        ctx = lane.inflight[-1]
        if not self._ranks.admit(lane, ctx):  # its input_dist is its first collective
            return  # dropped on every rank
        if on_worker and self._worker is not None and self._local:
            self._job = self._worker.submit(self._sparse, ctx)
        else:
            self._sparse(ctx)

    def _sparse(self, ctx: HostLookupBatchContext) -> None:
        """The sparse stage of `ctx` (each part a no-op once done): input_dist, lookup, outputs."""
        input_dist = self._input_dist
        input_dist.start(ctx)
        input_dist.wait_splits(ctx)
        self._lookup.run(ctx)
        for key, (_, _, output) in list(ctx.lookups.items()):
            ctx.embeddings[key] = output.wait()
            del ctx.lookups[key]
        if self._local is None and ctx.started:
            self._local = not _communicates(input_dist.modules)
            if self._worker is not None and not self._local and input_dist.report is not None:
                input_dist.report.notes.append(
                    "multi_thread: the sparse stage runs collectives (tables that are not "
                    "data-parallel), which must not run beside forward's on another thread: it "
                    "runs on the calling thread"
                )

    def _wait_sparse(self, *, discard: bool = False) -> None:
        """Wait for the sparse stage on the worker; re-raise its error unless `discard`."""
        job, self._job = self._job, None
        if job is not None and (job.exception() is None or not discard):
            job.result()

    def _to_device(self, ctx: HostLookupBatchContext) -> None:
        """The copy stage of `ctx`: its batch and embeddings to the device, on memcpy."""
        if ctx.on_device:
            return
        self._wait_sparse()
        self._sparse(ctx)  # a no-op once done; else (after a recorded first forward) now
        dense = self._dense
        with run_stage(dense, "copy", ctx.index, dense.memcpy):
            ctx.batch = self._to_dense_device(ctx.batch)
            ctx.embeddings = {key: self._to_dense_device(e) for key, e in ctx.embeddings.items()}
            for obj in (ctx.batch, *ctx.embeddings.values()):
                dense.produced(obj)
        ctx.on_device = True

    def _to_dense_device(self, obj: Any) -> Any:
        if self._dense_device.type == "cpu":
            return obj  # already there
        if self._in_place:
            return to_device_in_place(obj, self._dense_device, self._dense)
        return to_device(obj, self._dense_device, non_blocking=True)


def _communicates(modules: list[Any]) -> bool:
    """Whether the sharded modules' input or output dist moves data between ranks: more than one
    rank and a table that is not data-parallel (an unknown kind of module: assumed so)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return False
    kinds = [getattr(pm.module, "_sharding_types", None) for pm in modules]
    return any(k is None or any(t != "data_parallel" for t in k) for k in kinds)
