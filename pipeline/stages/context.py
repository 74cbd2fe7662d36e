"""Per-batch contexts (docs/reference.md, "Contexts"), the hijacked forwards' `rewrite.ForwardContext`;
each owns its batch's hand-offs until `Streams.release(ctx)`, after its backward or when dropped."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from torch.profiler import record_function
from torchrec.distributed.types import LazyNoWait

from pipeline.ranks.protocol import Ticket
from pipeline.stages.streams import NO_LABEL, Streams, profiling

__all__ = [
    "BatchContext",
    "HostLookupBatchContext",
    "LookupBatchContext",
    "PrefetchBatchContext",
    "TrainPipelineContext",
]


@dataclass(kw_only=True, slots=True, eq=False)
class BatchContext:
    """In-flight state of one batch; each field's comment says: its writer -> its reader."""

    index: int  # fetch -> labels: the batch's position in this pipeline's stream
    streams: Streams  # fetch -> the hand-offs below: the pipeline's streams
    batch: Any = None  # copy (memcpy) -> input_dist start (data_dist), forward
    module_contexts: dict[str, Any] = field(default_factory=dict)  # input_dist start -> forward, stages
    postproc_results: dict[str, Any] = field(default_factory=dict)  # input_dist start -> forward
    # input_dist start -> splits wait: (module FQNs, splits awaitable) per collective
    splits_requests: list[tuple[list[str], Any]] = field(default_factory=list)
    input_dist_requests: dict[str, Any] = field(default_factory=dict)  # splits wait -> forward, prefetch
    started: bool = False  # input_dist start -> the stages after it (never without input_dist)
    status_rides: bool = False  # input_dist start, status not yet known -> splits wait: run the batch?
    ticket: Ticket | None = None  # fetch (`pipeline.ranks.Ranks`) -> admission, before 1st collective
    loader_state: Any = None  # fetch: the loader's `state_dict()` before it -> `dataloader_state()`
    wait_clock: Any = None  # input_dist start, while the default schedule watches -> the timed waits
    copy_job: Future | None = None  # copy on a worker thread: the device batch's future -> `wait_copy`

    def wait_copy(self) -> None:
        """Put the device batch of a copy dispatched on a worker in `batch` (a no-op otherwise)."""
        if self.copy_job is not None:
            self.batch, self.copy_job = self.copy_job.result(), None

    def take_input_dist(self, key: str) -> tuple[Any, Any] | None:
        """Pop call site `key`'s input_dist result, waited on data_dist and handed (with its module
        context) to the current stream; None if nothing is prepared under `key`."""
        request = self.input_dist_requests.pop(key, None)
        if request is None:
            return None
        streams, clock, module_ctx = self.streams, self.wait_clock, self.module_contexts.pop(key)
        wait = request.wait if clock is None else partial(clock.timed, request.wait)
        # `label`, without a call or a string where no profiler records
        with record_function(f"pipeline::input_dist::wait#{self.index}") if profiling() else NO_LABEL:
            if streams.in_order:  # no streams: nothing to order or hold
                return module_ctx, wait()
            with streams.use(streams.data_dist):
                data = wait()
                streams.produced(data)
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


TrainPipelineContext = BatchContext  # torchrec's name; `context_type=` is accepted


@dataclass(kw_only=True, slots=True, eq=False)
class PrefetchBatchContext(BatchContext):
    """Adds what the prefetch stage hands to forward."""

    prefetch_job: Any = None  # prefetch submission (its future) -> main thread, before forward
    prefetched: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # prefetch -> `take_prefetched`

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

    lookups: dict[str, tuple[Any, Any, Any]] = field(default_factory=dict)  # lookup stage -> `take_lookup`
    looked_up: bool = False  # lookup stage -> lookup stage (it runs once per batch)

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
    """Adds the host lookups' outputs for a forward on the device (`EvalPipelineCPUSparse`)."""

    embeddings: dict[str, Any] = field(default_factory=dict)  # sparse stage, copy stage -> `take_lookup`
    on_device: bool = False  # copy stage -> copy stage: `batch` and `embeddings` are on the device

    def take_lookup(self, key: str) -> Any | None:
        embeddings = self.embeddings.pop(key, None)
        return None if embeddings is None else LazyNoWait(embeddings)
