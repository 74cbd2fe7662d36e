"""Per-batch contexts: what one batch carries between the pipeline's stages (one context per batch
in flight, none shared; each field names its writer and its reader: docs/reference.md, "Contexts").
The contexts implement `rewrite.ForwardContext`, the interface the hijacked forwards read, and do
the waiting and cross-stream hand-off for them. A context owns everything handed off for its batch
(`Streams.handoff(obj, producer, ctx)`) until the pipeline releases it (`Streams.release(ctx)`)
after the batch's backward, or when the batch is dropped.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from torchrec.distributed.types import LazyNoWait

from pipeline.ranks.lane import Ticket
from pipeline.stages.streams import Streams, label

__all__ = [
    "BatchContext",
    "HostLookupBatchContext",
    "LookupBatchContext",
    "PrefetchBatchContext",
    "TrainPipelineContext",
]


@dataclass(kw_only=True, slots=True, eq=False)
class BatchContext:
    """In-flight state of one batch."""

    index: int
    """Position of the batch in this pipeline's stream of batches (for labels)."""
    streams: Streams
    batch: Any = None
    """Written by copy (on memcpy); read by input_dist start (data_dist) and forward (default)."""
    module_contexts: dict[str, Any] = field(default_factory=dict)
    """Written by input_dist start, per call site key (`rewrite.site_key`: the module's FQN for its
    first call in forward, `fqn@1`... for the next); read by forward (or prefetch, or lookup)."""
    postproc_results: dict[str, Any] = field(default_factory=dict)
    """Written by input_dist start (pipelined postprocs run ahead); read by forward."""
    splits_requests: list[tuple[list[str], Any]] = field(default_factory=list)
    """Written by input_dist start: (module FQNs, splits awaitable) per collective; read by the
    splits wait, which issues the values all-to-alls."""
    input_dist_requests: dict[str, Any] = field(default_factory=dict)
    """Written by the splits wait: the values awaitable per module; read (popped) by forward's
    `take_input_dist`, or by the prefetch stage."""
    started: bool = False
    """input_dist start ran (for pipelines without input_dist: never)."""
    status_rides: bool = False
    """Started before every rank's status was known: the status rode on the splits, and the
    splits wait decides whether the batch runs."""
    ticket: Ticket | None = None
    """Written at fetch by the ranks' protocol (`pipeline.ranks.Ranks`): this rank's status for the
    batch, its vote, whether every rank admitted it; read before the batch's first collective."""
    loader_state: Any = None
    """Written at fetch: the dataloader's `state_dict()` from before this batch was fetched (None
    without one); read by `dataloader_state()` (`pipeline.ranks.protocol`)."""
    wait_clock: Any = None
    """Written by input_dist start while the default schedule watches (`pipeline.stages.watch`):
    the clock that the splits wait and `take_input_dist` report their blocking to; None: no clock."""
    copy_job: Future | None = None
    """Written by the copy stage when it dispatches the copy on a worker thread
    (`TrainPipelineSparseDistT`): the future of the device batch, while `batch` is still the host
    one; taken by `wait_copy` before the batch's first use on the device."""

    def wait_copy(self) -> None:
        """Put the device batch of a copy dispatched on a worker in `batch` (a no-op otherwise)."""
        if self.copy_job is not None:
            self.batch, self.copy_job = self.copy_job.result(), None

    def take_input_dist(self, key: str) -> tuple[Any, Any] | None:
        """Pop call site `key`'s input_dist result, wait for it on data_dist and hand it (and the
        module context) to the current stream. None if nothing is prepared under `key`."""
        request = self.input_dist_requests.pop(key, None)
        if request is None:
            return None
        streams = self.streams
        with label(f"pipeline::input_dist::wait#{self.index}"):
            with streams.use(streams.data_dist):
                clock = self.wait_clock  # while the default schedule watches: the wait is timed
                data = request.wait() if clock is None else clock.wait(request)
                streams.produced(data)
            module_ctx = self.module_contexts.pop(key)
            streams.handoff(data, streams.data_dist, self)
            streams.handoff(module_ctx, streams.data_dist, self)
        streams.consumed(data)
        return module_ctx, data

    def take_prefetched(self, key: str) -> tuple[Any, Any] | None:
        return None

    def take_lookup(self, key: str) -> Any | None:
        return None

    def postproc_result(self, fqn: str) -> Any | None:
        result = self.postproc_results.get(fqn)
        if result is not None:
            self.streams.handoff(result, self.streams.data_dist, self)
            self.streams.consumed(result)
        return result


TrainPipelineContext = BatchContext
"""torchrec's name for the per-batch context, here `BatchContext`: its fields are ours (each with its
writer and reader), since contexts are internal to the pipelines; `context_type=` is accepted."""


@dataclass(kw_only=True, slots=True, eq=False)
class PrefetchBatchContext(BatchContext):
    """Adds what the prefetch stage hands to forward."""

    prefetch_job: Any = None
    """Written by the prefetch submission (main thread): the future of this batch's prefetch stage;
    read by the main thread before forward."""
    prefetched: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    """Written by prefetch (on the prefetch stream): (module context, post-prefetch input) per
    module; read (popped) by forward's `take_prefetched`, which never waits on communication."""

    def take_prefetched(self, key: str) -> tuple[Any, Any] | None:
        prepared = self.prefetched.pop(key, None)
        if prepared is not None:
            module_ctx, data = prepared
            self.streams.handoff(data, self.streams.prefetch, self)
            self.streams.handoff(module_ctx, self.streams.prefetch, self)
            self.streams.consumed(data)
        return prepared


@dataclass(kw_only=True, slots=True, eq=False)
class LookupBatchContext(BatchContext):
    """Adds what the embedding lookup stage hands to forward (Fused and SemiSync pipelines)."""

    lookups: dict[str, tuple[Any, Any, Any]] = field(default_factory=dict)
    """Written by the lookup stage (on data_dist): (module context, input_dist result, output of
    `compute_and_output_dist`) per module; read (popped) by forward's `take_lookup`."""
    looked_up: bool = False
    """The lookup stage ran for this batch."""

    def take_lookup(self, key: str) -> Any | None:
        prepared = self.lookups.pop(key, None)
        if prepared is None:
            return None
        module_ctx, data, output = prepared
        streams = self.streams
        streams.handoff(output, streams.data_dist, self)
        # the lookup's backward reads its input (autograd saved the ids): held until the batch ends
        streams.handoff(module_ctx, streams.data_dist, self)
        streams.handoff(data, streams.data_dist, self)
        streams.consumed(output)
        return output


@dataclass(kw_only=True, slots=True, eq=False)
class HostLookupBatchContext(LookupBatchContext):
    """Adds the lookups' outputs made ready for a forward on another device
    (`EvalPipelineCPUSparse`: embeddings looked up on the host, forward on the device)."""

    embeddings: dict[str, Any] = field(default_factory=dict)
    """Written by the sparse stage (the host thread, or its worker): each call site's lookup
    output, waited for; replaced by its device copy in the copy stage (memcpy); read (popped) by
    forward's `take_lookup`, once the pipeline handed it to forward's stream."""
    on_device: bool = False
    """The copy stage ran: `batch` and `embeddings` are on the forward's device."""

    def take_lookup(self, key: str) -> Any | None:
        embeddings = self.embeddings.pop(key, None)
        return None if embeddings is None else LazyNoWait(embeddings)
