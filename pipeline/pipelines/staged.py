"""StagedTrainPipeline: the caller's own list of stages run ahead of forward (docs/reference.md,
"StagedTrainPipeline"; `SparseDataDistUtil`, in `sparse_data_dist.py`, makes the input_dist stage
and a prefetch or lookup stage after it).

With stages s_0 .. s_{n-1}, `progress()` returns batch i after s_{n-1}, having run, newest first,
s_0 on batch i+n, s_1 on batch i+n-1, ..., s_{n-1} on batch i+1; the caller runs forward, backward
and the optimizer on what it returns. Each stage runs on its own stream (CUDA), waiting for the
previous stage's event on that batch; on CPU (stream None) in that order on the calling thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pipeline.compat.types import TrainPipeline
from pipeline.ranks.failure import StopIterationInStepError
from pipeline.stages.cuda_streams import CudaStreams
from pipeline.stages.streams import Streams, label
from pipeline.stages.thread_streams import ThreadStreams

__all__ = ["PipelineStage", "StagedTrainPipeline", "device_stream", "util_streams"]

logger = logging.getLogger(__name__)


@dataclass
class PipelineStage:
    """One transform of a batch that needs no gradient (copy to device, a GPU postproc, input_dist).

    Args:
        name: for profiler labels (`pipeline::staged::<name>#<batch>`).
        runnable: takes the batch as the previous stage left it, returns it for the next stage.
        stream: the CUDA stream it runs on; None (or a CPU stream): the calling thread's.
        fill_callback: run after this stage while the pipeline fills (no forward runs then).
        data_exhausted_callback: run when the stage finds no batch (the dataloader ended).
    """

    name: str
    runnable: Callable[[Any], Any]
    stream: Any = None
    fill_callback: Callable[[], None] | None = None
    data_exhausted_callback: Callable[[], None] | None = None


def device_stream(stream: Any) -> bool:
    return stream is not None and getattr(getattr(stream, "device", None), "type", "cpu") != "cpu"


def util_streams(data_dist_stream: Any, prefetch_stream: Any, streams: Streams | None) -> Streams:
    """The streams of a `SparseDataDistUtil`'s stages: `streams` given (a test's
    `RecordingStreams`), it, with the stages' streams set; else CUDA streams when `data_dist_stream`
    is one; on CPU, none, or a prefetch worker thread."""
    if streams is not None:
        if data_dist_stream is not None and not streams.inert:
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
    """Runs user-defined `PipelineStage`s on the next batches while the caller trains the current one.

    Numerics: `progress()` returns exactly what running the stages in order on each batch would
    return, one batch per call in dataloader order; the caller's loop around it is the plain loop.
    When the data ends it returns None (torchrec's contract: `while (batch := pipe.progress(it))`),
    and keeps returning None for that iterator; a new iterator starts a new fill.

    Args:
        pipeline_stages: the stages, in the order they apply to a batch.
        debug_mode: log each stage as it runs.
        compute_stream: the stream forward runs on (CUDA); default: the current stream.
        on_flush_end: called once a flush (`set_flush(True)`) has emptied the pipeline.

    Keyword-only, ours:
        streams: the hand-offs between the stages' streams (tests pass `tests.streamcheck.RecordingStreams()`
            and its streams in the stages); None: CUDA hand-offs if a stage has a CUDA stream.
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
        self._streams = streams
        """Only for hand-offs between the stages' streams (each stage brings its own stream)."""
        self._compute_stream = compute_stream or streams.current()
        self._outputs: list[tuple[Any, Any, int]] = [(None, None, -1)] * len(self._stages)
        """Per batch in flight, oldest first: (output of its latest stage, its event, its index)."""
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
        """While flushing, no batch is fetched; once the batches in flight are returned, the
        pipeline calls `on_flush_end` and fills again."""
        self._flushing = flush

    def flush_end(self) -> None:
        self._flushing = False
        self._initialized = False
        if self.on_flush_end is not None:
            self.on_flush_end()

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """Run every stage once (newest batch first) and return the oldest batch, ready for forward.

        Returns:
            The output of the last stage for the next batch; None when the data has ended.

        Raises:
            StopIterationInStepError: a stage raised StopIteration (from it): let through, it would
                end a caller's loop that takes StopIteration for the end, on this rank alone.
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
        """Stage `st` on its stream (None or a CPU stream: the caller's), after the previous stage's `event`;
        returns its output and the event recorded after it (None without streams)."""
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
