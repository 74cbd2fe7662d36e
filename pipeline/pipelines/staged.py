"""StagedTrainPipeline: the caller's own list of stages run ahead of forward, and SparseDataDistUtil,
the stage that starts input_dist.

With stages s_0 .. s_{n-1}, `progress()` returns batch i after s_{n-1}, having run, newest first,
s_0 on batch i+n, s_1 on batch i+n-1, ..., s_{n-1} on batch i+1; the caller runs forward, backward
and the optimizer on what it returns. Each stage runs on its own stream (CUDA), waiting for the
previous stage's event on that batch; on CPU (stream None) stages run in that order on the calling
thread.

`SparseDataDistUtil.start_sparse_data_dist_stage()` is the stage that starts the input all-to-alls
of a batch (it must be the last stage, since forward takes its result): the model's sharded modules
are rewritten on its first batch, a forward pre-hook hands the oldest started batch to them, and a
forward hook waits for the next batch's splits (launching its values all-to-all) once forward is
done, as in TrainPipelineSparseDist's torchrec ("late") order.
"""

from __future__ import annotations

import logging
import sys
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipeline.compat.arguments import refuse_jit
from pipeline.compat.types import TrainPipeline
from pipeline.config import InputDistOptions, RewriteOptions, resolve
from pipeline.stages.context import BatchContext
from pipeline.stages.input_dist import InputDist
from pipeline.stages.labels import label
from pipeline.stages.streams import CudaStreams, Streams

__all__ = ["PipelineStage", "SparseDataDistUtil", "StagedTrainPipeline"]

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


def _device_stream(stream: Any) -> bool:
    return stream is not None and getattr(getattr(stream, "device", None), "type", "cpu") != "cpu"


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
        streams: the hand-offs between the stages' streams (tests pass `pipeline.RecordingStreams()`
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
        first = next((s.stream for s in self._stages if _device_stream(s.stream)), None)
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
        """
        if not self._initialized:
            self._fill(dataloader_iter)
        out, event, _ = self._outputs[0]
        self._outputs = [*self._outputs[1:], (None, None, -1)]
        if out is None:
            self._initialized = False  # a new iterator fills again
            if self._flushing:
                self.flush_end()
                return self.progress(dataloader_iter)
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
        """Stage `st` on its stream (None: the caller's), after the previous stage's `event`;
        returns its output and the event recorded after it (None without streams)."""
        streams = self._streams
        with label(f"pipeline::staged::{st.name}#{batch_index}"), streams.use(st.stream):
            stream, taken = streams.current(), object()
            streams.handoff_event(value, event, stream, taken)
            output = st.runnable(value)
            streams.produced(output)
            done = streams.event(stream)
            streams.release(taken)  # the stage's last use of its input is queued
        return output, done


class SparseDataDistUtil:
    """Makes the input_dist stage of a `StagedTrainPipeline` and hands its results to forward.

    Args (torchrec's, in its order):
        model: the sharded model the caller runs on each batch `progress()` returns.
        data_dist_stream: the CUDA stream of the input all-to-alls; None (or a CPU stream) on CPU.
        apply_jit: not supported; must be False.
        prefetch_stream, embedding_lookup_stream: torchrec's prefetch and lookup stages; not
            supported here, must be None (use `PrefetchTrainPipelineSparseDist` or
            `TrainPipelineFusedSparseDist`).
        pipeline_postproc: run parameter-free modules that transform the batch ahead.

    Keyword-only, ours:
        strict: fail on the first batch if a sharded module cannot be pipelined.
        rewrite_method, arg_paths: the fields of `RewriteOptions` (`rewrite` may give them).
        streams: the hand-offs of the input_dist results to forward's stream (tests pass
            `pipeline.RecordingStreams()`, with its `data_dist` as `data_dist_stream`); None: CUDA
            hand-offs if `data_dist_stream` is a CUDA stream.

    What forward took of a batch is released at the next forward, or at `detach()`: the caller's
    backward of that batch is queued by then.
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
        rewrite_method: str | None = None,
        arg_paths: dict[str, Any] | None = None,
        streams: Streams | None = None,
    ) -> None:
        refuse_jit(apply_jit)
        if prefetch_stream is not None or embedding_lookup_stream is not None:
            raise ValueError("SparseDataDistUtil here has no prefetch or lookup stage; pass None")
        if streams is None:
            streams = Streams()
            if _device_stream(data_dist_stream):
                streams = CudaStreams(data_dist_stream.device, prefetch=False)
        if data_dist_stream is not None and not streams.inert:
            streams.data_dist = data_dist_stream
        self.model = model
        self.data_dist_stream = data_dist_stream
        self._streams = streams
        # torchrec's order ("late" schedule, torchrec's process group); no votes: the stages fetch
        self._input_dist = InputDist(
            model,
            streams,
            rewrite=resolve(rewrite, RewriteOptions, method=rewrite_method, arg_paths=arg_paths),
            strict=strict,
            pipeline_postproc=pipeline_postproc,
            schedule=InputDistOptions(schedule="late"),
        )
        self._contexts: deque[BatchContext] = deque()
        """Batches whose input_dist started, oldest (the next forward's) first."""
        self._forwarded: list[BatchContext] = []
        """Batches whose forward ran, released at the next forward (their backward is queued)."""
        self._hooks: list[Any] = []
        self._next_index = 0
        self._recording: Any = None
        """The recording context of the forward that runs (a no-op once the rewrite is complete)."""

    @property
    def rewrite_report(self) -> Any:
        return self._input_dist.report

    def start_sparse_data_dist(self, batch: Any) -> Any:
        """The stage: start the input all-to-alls of `batch`; returns `batch` unchanged."""
        ctx = BatchContext(index=self._next_index, streams=self._streams, batch=batch)
        self._next_index += 1
        self._input_dist.start(ctx)
        if not self._hooks:
            self._hooks = [
                self.model.register_forward_pre_hook(self._before_forward),
                # always: a forward that raised must still end a recording (it patches torchrec)
                self.model.register_forward_hook(self._after_forward, always_call=True),
            ]
        self._contexts.append(ctx)
        return batch

    def wait_sdd_fill_callback(self) -> None:
        """While filling (no forward runs), wait for the splits of the batch just started."""
        if self._contexts:
            self._input_dist.wait_splits(self._contexts[-1])

    def data_exhausted_callback(self) -> None:
        """Nothing to do: the hooks stop finding batches once the last one is consumed."""

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        self._release_forwarded()
        ctx = self._contexts[0] if self._contexts else None
        if ctx is not None and not ctx.started:  # it waited for the recorded forward to start
            self._input_dist.start(ctx)
            self._input_dist.wait_splits(ctx)
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
        if self._contexts:  # the next batch's values all-to-all runs during backward
            self._input_dist.wait_splits(self._contexts[0])

    def detach(self) -> nn.Module:
        """Restore the model's own forwards; the next started batch re-attaches. Batches whose
        input_dist started are kept."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._release_forwarded()
        self._input_dist.detach()
        return self.model

    def _release_forwarded(self) -> None:
        while self._forwarded:
            self._streams.release(self._forwarded.pop())

    def start_sparse_data_dist_stage(
        self, name: str = "start_sparse_data_dist", runnable: Callable[[Any], Any] | None = None
    ) -> PipelineStage:
        """The `PipelineStage` that starts input_dist (the last stage of the list)."""
        return PipelineStage(
            name=name,
            runnable=runnable or self.start_sparse_data_dist,
            stream=self.data_dist_stream,
            fill_callback=self.wait_sdd_fill_callback,
            data_exhausted_callback=self.data_exhausted_callback,
        )
