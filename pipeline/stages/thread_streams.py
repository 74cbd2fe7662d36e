"""`ThreadStreams`: CPU streams where the prefetch stream is a worker thread (and `streams_for`, a
pipeline's default streams: this one, `CudaStreams` or none).

Work submitted to the prefetch stream runs in order on that thread, and a hand-off waits for the
future of the work that produced the object instead of `wait_stream`. Host memory needs no keeping
alive: a Python reference is all the worker needs, so `release` and `returned` stay no-ops.

A profiler that does not record every thread would drop the worker's events: while one runs, the
prefetch stage stays inline unless the caller declares otherwise (`profiling_all_threads()`).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Any

import torch

from pipeline.stages.cuda_streams import CudaStreams
from pipeline.stages.streams import Streams

__all__ = ["ThreadStreams", "all_threads_profiled", "profiling_all_threads", "streams_for"]

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


def all_threads_profiled() -> bool:
    """Whether the code runs inside `profiling_all_threads()`."""
    return _all_threads_profiled


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
        profiled = torch.autograd.profiler._is_profiler_enabled and not all_threads_profiled()
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

    def handoff(self, obj: Any, producer: Any, owner: Hashable | None = None) -> None:
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
    if prefetch_thread:
        return ThreadStreams()
    return Streams()
