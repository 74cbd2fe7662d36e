"""Streams and cross-stream hand-offs, in one place.

A pipeline runs each stage on a stream: the host-to-device copy on `memcpy`, the input all-to-all on
`data_dist`, the prefetch on `prefetch`, and forward/backward/optimizer on whatever stream the caller
is running on (read at each use, never a stream of our own: see meta-pytorch/torchrec#3306). Every
object made on one stream and used on another goes through `Streams.handoff`, which orders the
consumer after the producer and keeps the object's memory alive for the consumer.

Three implementations: `Streams` (CPU, no streams: every method is a no-op), `CudaStreams` (real
streams) and `ThreadStreams` (CPU, with a worker thread playing the prefetch stream: work submitted
to it runs in order there, and a hand-off waits for the producer's future instead of
`wait_stream`). The test double `pipeline.testing.RecordingStreams` logs every stage, wait, record
and use on named fake streams, so that a missing wait is caught on CPU. Nothing outside this module
asks which implementation it has: what differs is a method here.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

__all__ = [
    "CudaStreams",
    "Streams",
    "ThreadStreams",
    "profiling_all_threads",
    "streams_for",
]

_all_threads_profiled = False


@contextmanager
def profiling_all_threads() -> Iterator[None]:
    """Declare that the active torch.profiler records every thread, i.e. was made with
    `experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True)`.

    Inside it, `ThreadStreams` keeps the prefetch stage on its worker thread while the profiler
    runs, so the trace shows the overlap; outside it, the stage runs inline while profiling, since
    a profiler started without that option drops the worker thread's events.
    """
    global _all_threads_profiled
    previous, _all_threads_profiled = _all_threads_profiled, True
    try:
        yield
    finally:
        _all_threads_profiled = previous


class Streams:
    """No streams (CPU): stages run in program order on the calling thread."""

    memcpy: Any = None
    data_dist: Any = None
    prefetch: Any = None
    inert: bool = True
    """`use()` and `stage_started()` do nothing (no streams, no checking): a stage needs no
    bookkeeping while no profiler records (`pipeline.stages.labels.run_stage`)."""

    def current(self) -> Any:
        """The stream the caller is running on now (forward/backward/optimizer run there)."""
        return None

    def use(self, stream: Any):
        """Context manager running the enclosed work on `stream`."""
        return nullcontext()

    def record(self, obj: Any, stream: Any) -> None:
        """Keep `obj`'s memory alive until the work enqueued on `stream` so far is done."""

    def produced(self, obj: Any) -> None:
        """`obj` was just created on the current stream (a checking hook; no-op here)."""

    def consumed(self, obj: Any) -> None:
        """`obj` is about to be read on the current stream (a checking hook; no-op here)."""

    def stage_started(self, name: str) -> None:
        """Stage `name` starts on the current stream (a checking hook; no-op here)."""

    @property
    def has_prefetch_worker(self) -> bool:
        """Whether the prefetch stream is a worker thread (`ThreadStreams`)."""
        return False

    @property
    def prefetch_on_worker(self) -> bool:
        """Whether work submitted to the prefetch stream now runs on a worker thread."""
        return False

    def set_prefetch_on_worker(self, enabled: bool) -> None:
        """Run work submitted to the prefetch stream on the worker thread (True) or inline on the
        calling thread (False); a no-op without a worker."""

    def handoff_event(self, obj: Any, event: Any, consumer: Any) -> None:
        """Make `obj`, whose producer recorded `event` (None: none, or on the host), usable on the
        stream `consumer`: `consumer` waits for the event, and `obj` is recorded on it."""
        if event is None or consumer is None:
            return
        event.wait(consumer)
        self.record(obj, consumer)

    def submit(self, stream: Any, work: Callable[[], None]) -> Future:
        """Run `work` on `stream`; the returned future's `result()` waits for it on the host.

        With CUDA or no streams the work is enqueued (or run) now, on the calling thread; on a
        thread-backed stream it runs later, in order, on that stream's thread.
        """
        done: Future = Future()
        with self.use(stream):
            work()
        done.set_result(None)
        return done

    def wait_all(self) -> None:
        """Wait for all work submitted so far (before a detach).

        Raises:
            BaseException: the first error of that work that no hand-off raised yet.
        """

    def discard(self) -> None:
        """Wait for all work submitted so far and drop its errors (a reset after an exception,
        which is being raised already)."""

    def handoff(self, obj: Any, producer: Any) -> None:
        """Make `obj`, produced on stream `producer`, usable on the current stream.

        Orders the current stream after everything enqueued on `producer` so far, and records
        `obj` on the current stream so its memory is not reused while this stream still reads it.
        Must be called after `obj` was produced and before the current stream first uses it.
        """
        consumer = self.current()
        if producer is None or consumer is None or consumer == producer:
            return
        consumer.wait_stream(producer)
        self.record(obj, consumer)


class CudaStreams(Streams):
    """Side streams on a CUDA device; copy and communication at high priority."""

    inert = False

    def __init__(self, device: torch.device, *, prefetch: bool = True, data_dist: bool = True) -> None:
        high = torch.cuda.Stream.priority_range()[1]  # lowest number is the highest priority
        self.device = device
        self.memcpy = torch.cuda.Stream(device=device, priority=high)
        # without: input_dist runs on the caller's stream (no memory pool of another stream)
        self.data_dist = torch.cuda.Stream(device=device, priority=high) if data_dist else None
        self.prefetch = torch.cuda.Stream(device=device) if prefetch else None

    def current(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def use(self, stream: Any):
        return torch.cuda.stream(stream) if stream is not None else nullcontext()

    def record(self, obj: Any, stream: Any) -> None:
        _record_stream(obj, stream)


def _record_stream(obj: Any, stream: Any) -> None:
    if isinstance(obj, torch.Tensor):
        obj.record_stream(stream)
    elif hasattr(obj, "record_stream"):
        obj.record_stream(stream)
    elif isinstance(obj, dict):
        for v in obj.values():
            _record_stream(v, stream)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _record_stream(v, stream)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _record_stream(getattr(obj, f.name), stream)


class _WorkerStream:
    """A thread that runs submitted work in order: the CPU stand-in for a CUDA side stream."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"pipeline-{name}")
        self._last: Future | None = None
        self._pending: deque[Future] = deque()
        """Work submitted since the last `wait_all` or `discard`, less what finished without error
        (dropped at each submission: a training run submits one job a step, for days)."""
        self._local = threading.local()

    def submit(self, work: Callable[[], None]) -> Future:
        job: Future = Future()

        def run() -> None:
            self._local.job = job
            try:
                work()
            except BaseException as error:
                job.set_exception(error)
            else:
                job.set_result(None)
            finally:
                self._local.job = None

        pending = self._pending
        while pending and pending[0].done() and pending[0].exception() is None:
            pending.popleft()
        self._executor.submit(run)
        self._last = job
        pending.append(job)
        return job

    @property
    def job(self) -> Future | None:
        """On the worker thread, the future of the work it is running; else None."""
        return getattr(self._local, "job", None)

    def join(self) -> None:
        """Wait for everything submitted so far; re-raises the error of the last work."""
        if self._last is not None:
            self._last.result()

    def wait_all(self) -> None:
        """Wait for everything submitted so far; re-raise the first error among it. (An error a
        hand-off already raised inside `progress()` was dropped by the reset that followed it.)"""
        pending, self._pending, self._last = self._pending, deque(), None
        wait(pending)
        for job in pending:
            if job.exception() is not None:
                raise job.exception()

    def discard(self) -> None:
        """Wait for everything submitted so far and forget its errors: a later `join` raises only
        what fails after this."""
        pending, self._pending, self._last = self._pending, deque(), None
        wait(pending)


class ThreadStreams(Streams):
    """CPU streams where the prefetch stage runs on a worker thread.

    On a CPU, a prefetch that waits (on the disk, on the all-to-all) overlaps the main thread's
    backward only if it runs on another thread; CPU-bound work moved there competes with compute.
    A hand-off of an object the worker produced waits for the work that produced it (its future;
    other objects: for everything submitted so far), which is what `wait_stream` does on CUDA;
    memory needs no recording on the host.
    """

    def __init__(self) -> None:
        self.prefetch = _WorkerStream("prefetch")
        self._threaded = True  # False: work submitted to the prefetch stream runs inline
        self._made_by: dict[int, Future] = {}  # id of an object the worker produced -> its job

    @property
    def has_prefetch_worker(self) -> bool:
        return True

    def set_prefetch_on_worker(self, enabled: bool) -> None:
        self._threaded = enabled

    @property
    def prefetch_on_worker(self) -> bool:
        # torch.profiler records only the threads it was started on, unless told otherwise: while it
        # runs, work stays on the calling thread so that every stage keeps its label.
        profiled = torch.autograd.profiler._is_profiler_enabled and not _all_threads_profiled
        return self._threaded and not profiled

    def submit(self, stream: Any, work: Callable[[], None]) -> Future:
        if isinstance(stream, _WorkerStream) and self.prefetch_on_worker:
            return stream.submit(work)
        if isinstance(stream, _WorkerStream):
            stream.join()  # in order with what was submitted before
            stream = None
        return super().submit(stream, work)

    def wait_all(self) -> None:
        try:
            self.prefetch.wait_all()
        finally:
            self._made_by.clear()

    def discard(self) -> None:
        self.prefetch.discard()
        self._made_by.clear()

    def produced(self, obj: Any) -> None:
        job = self.prefetch.job
        if job is not None:
            self._made_by[id(obj)] = job

    def handoff(self, obj: Any, producer: Any) -> None:
        # Wait for the work that made `obj`, not for everything submitted since: the prefetch of
        # batch i+1 may already be running when forward of i takes batch i's prefetched input.
        if isinstance(producer, _WorkerStream):
            job = self._made_by.pop(id(obj), None)
            if job is not None:
                job.result()
            else:
                producer.join()


def streams_for(device: torch.device, *, prefetch_thread: bool = False, data_dist: bool = True) -> Streams:
    """Real streams on CUDA (without a data_dist stream unless `data_dist`); on CPU none, or a
    prefetch worker thread if `prefetch_thread`."""
    if device.type == "cuda":
        return CudaStreams(device, data_dist=data_dist)
    return ThreadStreams() if prefetch_thread else Streams()
