"""`StagedTrainPipeline` runs the caller's own `PipelineStage`s on the batches ahead, each on its
stream; `SparseDataDistUtil` makes its input_dist stage (docs/reference.md, "StagedTrainPipeline")."""

from __future__ import annotations

import logging
import sys
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipeline.compat import TrainPipeline, refuse_jit
from pipeline.options import InputDistOptions, PrefetchOptions, RewriteOptions
from pipeline.ranks.failure import StopIterationInStepError
from pipeline.stages.context import BatchContext, LookupBatchContext, PrefetchBatchContext
from pipeline.stages.input_dist import InputDist
from pipeline.stages.lookup import LookupStage
from pipeline.stages.prefetch import PrefetchStage
from pipeline.stages.streams import CudaStreams, Streams, ThreadStreams, label

__all__ = ["PipelineStage", "SparseDataDistUtil", "StagedTrainPipeline", "device_stream", "util_streams"]

logger = logging.getLogger(__name__)


@dataclass
class PipelineStage:
    """One transform of a batch that needs no gradient (copy to device, a GPU postproc, input_dist).

    Args:
        name: for profiler labels (`pipeline::staged::<name>#<batch>`).
        runnable: takes the batch as the previous stage left it, returns it for the next stage.
        stream: the CUDA stream it runs on; None (or a CPU stream): the calling thread's.
        fill_callback: run after this stage while the pipeline fills (no forward runs then).
        data_exhausted_callback: run when the stage finds no batch.
    """

    name: str
    runnable: Callable[[Any], Any]
    stream: Any = None
    fill_callback: Callable[[], None] | None = None
    data_exhausted_callback: Callable[[], None] | None = None


def device_stream(stream: Any) -> bool:
    return stream is not None and getattr(getattr(stream, "device", None), "type", "cpu") != "cpu"


def util_streams(data_dist_stream: Any, prefetch_stream: Any, streams: Streams | None) -> Streams:
    """The streams of a `SparseDataDistUtil`'s stages: `streams` (with the stages' streams set) if
    given; else CUDA streams if `data_dist_stream` is one; else none, or a prefetch worker thread."""
    if streams is not None:
        if data_dist_stream is not None and not streams.in_order:
            streams.data_dist = data_dist_stream
        return streams
    if device_stream(data_dist_stream):
        streams = CudaStreams(data_dist_stream.device, prefetch=prefetch_stream is not None)
        streams.data_dist = data_dist_stream
        if device_stream(prefetch_stream):
            streams.prefetch = prefetch_stream
        return streams
    return ThreadStreams() if prefetch_stream is not None else Streams()


class StagedTrainPipeline(TrainPipeline):
    """Runs the caller's `PipelineStage`s on the next batches while the caller trains the current one:
    the `progress()` call that returns batch i runs stage 0 on batch i+n, ..., stage n-1 on batch i+1.

    Args:
        pipeline_stages: the stages (at least one), in the order they apply to a batch.
        debug_mode: log each stage as it runs.
        compute_stream: the stream forward runs on (CUDA); default: the current stream.
        on_flush_end: called once a flush (`set_flush(True)`) has emptied the pipeline.
        streams: keyword-only, ours: the stages' hand-offs; None: CUDA ones where a stage has a stream.

    Raises:
        ValueError: no stage.
    """

    def __init__(
        self,
        pipeline_stages: list[PipelineStage],
        debug_mode: bool = False,
        compute_stream: Any = None,
        on_flush_end: Callable[[], None] | None = None,
        *,
        streams: Streams | None = None,
    ) -> None:
        if not pipeline_stages:
            raise ValueError("StagedTrainPipeline needs at least one stage")
        self._stages = list(pipeline_stages)
        self._debug = debug_mode
        first = next((s.stream for s in self._stages if device_stream(s.stream)), None)
        if streams is None:
            streams = CudaStreams(first.device, prefetch=False) if first is not None else Streams()
        self._streams = streams  # only for hand-offs: each stage brings its own stream
        self._compute_stream = compute_stream or streams.current()
        # per batch in flight, oldest first: (output of its latest stage, its event, its index)
        self._outputs: list[tuple[Any, Any, int]] = [(None, None, -1)] * len(self._stages)
        self._initialized = False
        self._iterator: Iterator[Any] | None = None
        self._exhausted = False
        self._flushing = False
        self._fetched = 0
        self.on_flush_end = on_flush_end
        TrainPipeline.__init__(self)

    @property
    def num_stages(self) -> int:
        return len(self._stages)

    def set_flush(self, flush: bool) -> None:
        """While flushing no batch is fetched; once those in flight are returned, `on_flush_end` runs
        and the pipeline fills again."""
        self._flushing = flush

    def flush_end(self) -> None:
        self._flushing = False
        self._initialized = False
        if self.on_flush_end is not None:
            self.on_flush_end()

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """Run every stage once (newest batch first) and return the oldest batch, ready for forward.

        Returns:
            The last stage's output for it; None once the data ended (a new iterator fills again).

        Raises:
            StopIterationInStepError: a stage raised StopIteration (it would end this rank's loop alone).
        """
        try:
            return self._progress(dataloader_iter)
        except StopIteration as stop:  # the data's end is None here: a StopIteration is a stage's
            raise StopIterationInStepError() from stop

    def _progress(self, dataloader_iter: Iterator[Any]) -> Any:
        if not self._initialized:
            self._fill(dataloader_iter)
        out, event, _ = self._outputs[0]
        self._outputs = [*self._outputs[1:], (None, None, -1)]
        if out is None:
            self._initialized = False  # a new iterator fills again
            if self._flushing:
                self.flush_end()
                return self._progress(dataloader_iter)
            return None
        n = self.num_stages
        for index in range(n):
            self._run(index, n - 1 - index, dataloader_iter)
        streams = self._streams
        streams.handoff_event(None, event, self._compute_stream)
        with streams.use(self._compute_stream):
            streams.returned(out)  # the caller's own: used until it drops it, past any point of ours
        return out

    def _fill(self, dataloader_iter: Iterator[Any]) -> None:
        n = self.num_stages
        for offset in range(n):
            for index in range(n - offset):
                self._run(index, offset, dataloader_iter, fill=True)
        self._initialized = True

    def _next_batch(self, dataloader_iter: Iterator[Any]) -> Any:
        if dataloader_iter is not self._iterator:
            self._iterator, self._exhausted = dataloader_iter, False
        if self._exhausted or self._flushing:
            return None
        batch = next(dataloader_iter, None)
        self._exhausted = batch is None
        self._fetched += batch is not None
        return batch

    def _run(self, index: int, offset: int, dataloader_iter: Iterator[Any], fill: bool = False) -> None:
        """Stage `index` on the batch `offset` places from the head."""
        st = self._stages[index]
        if index == 0:
            batch_index = self._fetched
            value, event = self._next_batch(dataloader_iter), None
        else:
            value, event, batch_index = self._outputs[offset]
        if value is None:
            self._outputs[offset] = (None, None, -1)
            if st.data_exhausted_callback is not None:
                st.data_exhausted_callback()
        else:
            if self._debug:
                logger.info("pipeline::staged::%s#%d", st.name, batch_index)
            output, done = self._run_on_stream(st, value, event, batch_index)
            self._outputs[offset] = (output, done, batch_index)
        if fill and st.fill_callback is not None:
            st.fill_callback()

    def _run_on_stream(self, st: PipelineStage, value: Any, event: Any, batch_index: int) -> tuple[Any, Any]:
        """Stage `st` on its stream after the previous stage's `event`; returns its output and event."""
        streams = self._streams
        on_host = getattr(getattr(st.stream, "device", None), "type", None) == "cpu"  # torch.Stream("cpu")
        with label(f"pipeline::staged::{st.name}#{batch_index}"), streams.use(None if on_host else st.stream):
            stream, taken = streams.current(), object()
            streams.handoff_event(value, event, stream, taken)
            output = st.runnable(value)
            streams.produced(output)
            done = streams.event(stream)
            streams.release(taken)  # the stage's last use of its input is queued
        return output, done


# the batches' context, by the stage that follows input_dist ("input_dist": none)
_CONTEXTS = {"input_dist": BatchContext, "prefetch": PrefetchBatchContext, "lookup": LookupBatchContext}


class SparseDataDistUtil:
    """Makes the input_dist stage of a `StagedTrainPipeline` (and a prefetch or lookup stage after it);
    forward hooks on the model give the sharded modules the oldest started batch and, after forward,
    wait for the splits of the batches started since (torchrec's "late" order).

    Args:
        model: the sharded model the caller runs on each batch `progress()` returns.
        data_dist_stream: the CUDA stream of the input all-to-alls; None (or a CPU stream) on CPU.
        apply_jit: not supported; must be False.
        prefetch_stream: given (on CPU a CPU one): `prefetch` is a stage, right after input_dist's.
        pipeline_postproc: run parameter-free modules that transform the batch ahead.
        embedding_lookup_stream: given (not with `prefetch_stream`): `start_embedding_lookup_stage()`
            is a stage right after input_dist's, looking batch i+1 up before batch i's update
            (embeddings one step stale).
        strict: keyword-only from here: fail on the first batch if a module cannot be pipelined.
        rewrite: how the sharded modules' inputs are found.
        input_dist: only its `narrow_ids` is read.
        streams: the hand-offs of the stages' results to forward's stream; None: CUDA hand-offs if
            `data_dist_stream` is CUDA.

    Raises:
        ValueError: both `prefetch_stream` and `embedding_lookup_stream`, or `apply_jit`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        data_dist_stream: Any = None,
        apply_jit: bool = False,
        prefetch_stream: Any = None,
        pipeline_postproc: bool = False,
        embedding_lookup_stream: Any = None,
        *,
        strict: bool = False,
        rewrite: RewriteOptions | None = None,
        input_dist: InputDistOptions | None = None,
        streams: Streams | None = None,
    ) -> None:
        refuse_jit(apply_jit)
        if prefetch_stream is not None and embedding_lookup_stream is not None:
            raise ValueError(
                "SparseDataDistUtil: pass prefetch_stream or embedding_lookup_stream, not both "
                "(the lookup stage already waits for input_dist; a prefetch before it adds nothing)"
            )
        extra = "lookup" if embedding_lookup_stream is not None else "input_dist"
        self._extra = "prefetch" if prefetch_stream is not None else extra  # as `_CONTEXTS` names it
        self.model = model
        self.data_dist_stream = data_dist_stream
        self.prefetch_stream = prefetch_stream
        self.embedding_lookup_stream = embedding_lookup_stream
        self._streams = streams = util_streams(data_dist_stream, prefetch_stream, streams)
        # the prefetch stage runs on its own stream, forward on the caller's
        self._forward_stream = streams.current()
        # no votes among the ranks: the stages fetch the batches
        self._input_dist = InputDist(
            model,
            streams,
            rewrite=rewrite or RewriteOptions(),
            strict=strict,
            pipeline_postproc=pipeline_postproc,
            schedule=InputDistOptions(
                schedule="late", narrow_ids=(input_dist or InputDistOptions()).narrow_ids
            ),
            forward=self._extra,
        )
        self._prefetch: PrefetchStage | None = None
        self._lookup: LookupStage | None = None
        if self._extra == "prefetch":
            self._prefetch = PrefetchStage(streams, self._input_dist, ahead=PrefetchOptions().prefetch_ahead)
        elif self._extra == "lookup":
            # the staged pipeline makes the stage's stream current: the lookup runs on the caller's
            self._lookup = LookupStage(streams, self._input_dist, model, None, on_caller_stream=True)
        self._contexts: deque[BatchContext] = deque()  # input_dist started; the next forward's first
        self._awaiting_stage: deque[BatchContext] = deque()  # their prefetch or lookup has not run
        self._forwarded: list[BatchContext] = []  # released at the next forward
        self._hooks: list[Any] = []
        self._next_index = 0
        self._recording: Any = None  # of the forward that runs

    @property
    def rewrite_report(self) -> Any:
        return self._input_dist.report

    def start_sparse_data_dist(self, batch: Any) -> Any:
        """The stage: start the input all-to-alls of `batch`; returns `batch` unchanged."""
        ctx = _CONTEXTS[self._extra](index=self._next_index, streams=self._streams, batch=batch)
        self._next_index += 1
        self._input_dist.start(ctx)
        if not self._hooks:
            self._hooks = [
                self.model.register_forward_pre_hook(self._before_forward),
                # always: a forward that raised must still end a recording (it patches torchrec)
                self.model.register_forward_hook(self._after_forward, always_call=True),
            ]
        self._contexts.append(ctx)
        if self._extra != "input_dist":
            self._awaiting_stage.append(ctx)
        return batch

    def wait_sparse_data_dist(self) -> None:
        """Wait for the splits of every started batch (launching their values all-to-alls)."""
        for ctx in self._contexts:
            self._input_dist.wait_splits(ctx)  # a no-op once done

    def wait_sdd_fill_callback(self) -> None:
        """While filling, wait for the splits of the batch just started."""
        if self._contexts:
            self._input_dist.wait_splits(self._contexts[-1])

    def data_exhausted_callback(self) -> None:
        """Nothing to do: the hooks stop finding batches once the last one is consumed."""

    def prefetch(self, batch: Any) -> Any:
        """The stage: each module's `prefetch()` for `batch` after its input_dist; returns `batch`."""
        ctx = self._stage_context(batch, "prefetch", "prefetch")
        if ctx.started:  # else the forward that is recorded starts it, and its prefetch
            self._input_dist.wait_splits(ctx)
            self._prefetch.submit(ctx, self._forward_stream)
        return batch

    def load_prefetch(self) -> None:
        """torchrec's fill callback of the prefetch stage, kept for its users; nothing to do."""

    def start_embedding_lookup(self, batch: Any) -> Any:
        """The stage: look `batch` up after its input_dist, starting its output all-to-all; returns it."""
        ctx = self._stage_context(batch, "lookup", "start_embedding_lookup")
        self._lookup.run(ctx)
        return batch

    def _stage_context(self, batch: Any, extra: str, name: str) -> BatchContext:
        """The context of `batch`, the oldest whose prefetch/lookup stage has not run."""
        if self._extra != extra:
            arg = "prefetch_stream" if extra == "prefetch" else "embedding_lookup_stream"
            raise ValueError(f"SparseDataDistUtil.{name} is a stage only when {arg} is given")
        if not self._awaiting_stage or self._awaiting_stage[0].batch is not batch:
            raise ValueError(
                f"SparseDataDistUtil.{name} got a batch whose input_dist it did not start: place its "
                "stage right after start_sparse_data_dist_stage(), with no stage between that "
                "returns another object"
            )
        return self._awaiting_stage.popleft()

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        self._release_forwarded()
        ctx = self._contexts[0] if self._contexts else None
        if ctx is not None and not ctx.started:  # it waited for the recorded forward to start
            self._input_dist.start(ctx)
            self._input_dist.wait_splits(ctx)
            if self._lookup is not None:
                self._lookup.run(ctx)
        if ctx is not None and self._awaiting_stage and self._awaiting_stage[0] is ctx:
            raise RuntimeError(
                f"SparseDataDistUtil was given a {self._extra} stream, but the {self._extra} "
                "stage did not run for this batch: put it in the StagedTrainPipeline's stages, right "
                "after start_sparse_data_dist_stage()"
            )
        if ctx is not None and self._prefetch is not None:
            self._prefetch.wait(ctx)
        self._input_dist.slot.current = ctx
        self._recording = self._input_dist.recording(ctx) if ctx is not None else None
        if self._recording is not None:
            self._recording.__enter__()

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self._input_dist.slot.current = None
        recording, self._recording = self._recording, None
        if recording is not None:
            recording.__exit__(*sys.exc_info())  # raising inside forward: the exception, else Nones
        elif sys.exc_info()[0] is None:
            self._input_dist.slot.check_calls()
        if self._contexts:
            self._forwarded.append(self._contexts.popleft())
        self.wait_sparse_data_dist()  # the values all-to-alls run during backward

    def detach(self) -> nn.Module:
        """Restore the model's own forwards (the next started batch re-attaches); started batches stay."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._release_forwarded()
        self._streams.wait_all()
        self._input_dist.detach()
        return self.model

    def _release_forwarded(self) -> None:
        while self._forwarded:
            self._streams.release(self._forwarded.pop())

    def start_sparse_data_dist_stage(
        self, name: str = "start_sparse_data_dist", runnable: Callable[[Any], Any] | None = None
    ) -> PipelineStage:
        """The `PipelineStage` that starts input_dist (the last, or before the prefetch/lookup stage)."""
        return PipelineStage(
            name=name,
            runnable=runnable or self.start_sparse_data_dist,
            stream=self.data_dist_stream,
            fill_callback=self.wait_sdd_fill_callback,
            data_exhausted_callback=self.data_exhausted_callback,
        )

    def start_embedding_lookup_stage(
        self, name: str = "start_embedding_lookup", runnable: Callable[[Any], Any] | None = None
    ) -> PipelineStage:
        """The `PipelineStage` of the embedding lookup (the last, right after input_dist's).

        Raises:
            ValueError: no `embedding_lookup_stream` was given.
        """
        if self.embedding_lookup_stream is None:
            raise ValueError(
                "start_embedding_lookup_stage() needs SparseDataDistUtil(..., embedding_lookup_stream=...)"
                " (on CPU any stream, e.g. torch.Stream('cpu'))"
            )
        return PipelineStage(
            name=name, runnable=runnable or self.start_embedding_lookup, stream=self.embedding_lookup_stream
        )
