"""Streams and cross-stream hand-offs, in one place (docs/reference.md, "Streams and hand-offs").

Each stage runs on a stream: the copy on `memcpy`, the input all-to-all on `data_dist`, the
prefetch on `prefetch`, forward/backward/optimizer on the caller's (read at each use, so that the
work is ordered with the user's code around `progress()`). Every object made on one stream and used
on another goes through `Streams.handoff`; `release` and `returned` end what it holds. The held
object is kept alive by ordering, not `record_stream` (`KeepAlive`: each consumer records an event
after its last use, and the reference goes once it completed, FSDP2's way); `record_stream` remains
for what `returned` gives the caller, for a storage freed while a side stream still copies it
(`free_after`), and inside torchrec's and fbgemm's own APIs. Implementations: `Streams` (CPU:
no-ops), `CudaStreams`, `ThreadStreams` (CPU, the prefetch stream a worker thread, a hand-off
waiting for the future of the work that made the object); the test double
`tests.streamcheck.RecordingStreams` shares `OrderedStreams`' hand-off. Stages run under profiler
labels `pipeline::<stage>#<batch index>` (`run_stage`, `label`; what the timeline tool reads), made
only while a profiler records: a `record_function` costs 8-15 us even with none running.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch._C._autograd import _profiler_enabled
from torch.autograd import profiler as autograd_profiler
from torch.profiler import record_function

__all__ = [
    "HANDOFFS",
    "CudaStreams",
    "KeepAlive",
    "OrderedStreams",
    "Streams",
    "ThreadStreams",
    "all_threads_profiled",
    "label",
    "profiling_all_threads",
    "run_stage",
    "streams_for",
]


# -- profiler labels, and the streams' interface -----------------------------------------------------


HANDOFFS = ("keep-alive", "record-stream")
"""How a hand-off keeps memory alive: "keep-alive" (`KeepAlive`) or "record-stream"
(`Tensor.record_stream` on the consumer: the previous way, kept to measure the difference)."""


class Streams:
    """No streams (CPU): stages run in program order on the calling thread."""

    memcpy: Any = None
    data_dist: Any = None
    prefetch: Any = None
    inert: bool = True
    """`use()` and `stage_started()` do nothing (no streams, no checking): a stage needs no
    bookkeeping while no profiler records (`run_stage`)."""

    def current(self) -> Any:
        """The stream the caller is running on now (forward/backward/optimizer run there)."""
        return None

    def use(self, stream: Any):
        """Context manager running the enclosed work on `stream`."""
        return nullcontext()

    def record(self, obj: Any, stream: Any) -> None:
        """`record_stream(stream)` on every tensor of `obj` (see the module's docstring for where)."""

    def free_after(self, tensor: Any, stream: Any) -> None:
        """`tensor`'s storage is freed next while `stream` still reads it (a stash's copy): its block
        is not reused before the work queued on `stream` so far is done. A freed storage leaves no
        object to keep alive, and ordering the caller's stream after the copy would stall it: this
        is where `record_stream` stays under either hand-off."""

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

    def submit(self, stream: Any, work: Callable[[], None]) -> Future:
        """Run `work` on `stream` (enqueued or run now; on a thread-backed stream, later, in order,
        on its thread); the returned future's `result()` waits for it on the host."""
        done: Future = Future()
        with self.use(stream):
            work()
        done.set_result(None)
        return done

    def wait_all(self) -> None:
        """Wait for all work submitted so far, and for the streams' last uses of what was
        released (before a detach or a checkpoint); what batches in flight hold stays held.

        Raises:
            BaseException: the first error of that work that no hand-off raised yet.
        """

    def discard(self) -> None:
        """Wait for all work submitted so far and drop its errors; release and drop everything
        held (a reset after an exception, which drops every batch in flight)."""

    def close(self) -> None:
        """`discard`, then end the threads the streams run on (their pipeline's `close()`)."""
        self.discard()

    def handoff(self, obj: Any, producer: Any, owner: Hashable | None = None) -> None:
        """Make `obj`, produced on stream `producer`, usable on the current stream.

        Orders the current stream after everything enqueued on `producer` so far, and holds `obj`
        for the current stream until `release(owner)`. Must be called after `obj` was produced and
        before the current stream first uses it. `obj` None: only the order (a fence).
        """

    def handoff_event(self, obj: Any, event: Any, consumer: Any, owner: Hashable | None = None) -> None:
        """`handoff` where the producer recorded `event` (None: none, or on the host): `consumer`
        waits for the event, and `obj` is held for it until `release(owner)`."""

    def event(self, stream: Any) -> Any:
        """An event recorded now on `stream`, for `handoff_event` (None without streams)."""
        return None

    def release(self, owner: Hashable) -> None:
        """Every stream that took one of `owner`'s objects has queued its last use (the end of a
        batch: after its backward, where autograd reads what forward saved; or its drop): each
        records an event now; the objects go once it has completed (`KeepAlive`)."""

    def returned(self, obj: Any) -> None:
        """`obj` leaves the pipeline for the caller, who reads it on the current stream after any
        point the pipeline can order: its tensors are recorded on that stream."""

    def poll(self) -> None:
        """Drop what the streams are done with (queries only): before a step allocates, so that
        the allocator can reuse it, as it would under `record_stream`."""

    @property
    def kept(self) -> int:
        """Objects held for a consumer stream now (0 without streams)."""
        return 0


class OrderedStreams(Streams):
    """The hand-off of real or fake streams: a wait, then the object held (`KeepAlive`) or, under
    `handoff="record-stream"`, recorded. `CudaStreams` and `tests.streamcheck.RecordingStreams`
    supply the streams, the events and `record`.

    Args:
        new_event: makes an event with `record(stream)`, `wait(stream)`, `query()`, `synchronize()`.
        handoff: one of `HANDOFFS`.
        log: what `KeepAlive` reports each hold, release and drop to (a checking test double).
    """

    inert = False

    def __init__(
        self, new_event: Callable[[], Any], *, handoff: str, log: Callable[[tuple], None] | None = None
    ) -> None:
        if handoff not in HANDOFFS:
            raise ValueError(f"handoff must be one of {HANDOFFS}; got {handoff!r}")
        self.handoff_mode = handoff
        self.keep_alive = KeepAlive(new_event, log)
        self._make_event = new_event

    def handoff(self, obj: Any, producer: Any, owner: Hashable | None = None) -> None:
        consumer = self.current()
        if producer is None or consumer == producer:
            return
        consumer.wait_stream(producer)
        self._keep(obj, consumer, owner)

    def handoff_event(self, obj: Any, event: Any, consumer: Any, owner: Hashable | None = None) -> None:
        if event is None or consumer is None:
            return
        event.wait(consumer)
        self._keep(obj, consumer, owner)

    def _keep(self, obj: Any, consumer: Any, owner: Hashable | None) -> None:
        if obj is None:
            return
        if self.handoff_mode == "record-stream":
            self.record(obj, consumer)
        elif owner is None:
            raise ValueError("a hand-off of an object needs its owner (the batch's context), to release it")
        else:
            self.keep_alive.hold(obj, consumer, owner)

    def event(self, stream: Any) -> Any:
        event = self._make_event()
        event.record(stream)
        return event

    def release(self, owner: Hashable) -> None:
        self.keep_alive.release(owner)

    def returned(self, obj: Any) -> None:
        # The caller may keep parts of a batch (labels) past the step and read them on its stream;
        # memory another stream allocated must then wait for that stream at its free, which only
        # record_stream can say. On memory the caller's stream allocated it is a no-op.
        self.record(obj, self.current())

    def poll(self) -> None:
        self.keep_alive.poll()

    def wait_all(self) -> None:
        self.keep_alive.wait()

    def discard(self) -> None:
        self.keep_alive.release_all()

    @property
    def kept(self) -> int:
        return self.keep_alive.size


_NO_LABEL = nullcontext()


def _recording() -> bool:
    """Whether a profiler records (either flag: see the module's docstring)."""
    return _profiler_enabled() or autograd_profiler._is_profiler_enabled


def label(text: str) -> Any:
    """A context manager labelling the enclosed work `text` while a profiler records (else a no-op)."""
    return record_function(text) if _recording() else _NO_LABEL


def run_stage(streams: Streams, name: str, index: int, stream: Any = None) -> Any:
    """A context manager running the enclosed work as stage `name` of batch `index` on `stream`
    (None: the current one). With inert streams and no profiler recording, a shared no-op: a step's
    stages then cost one call each on the hot path."""
    if streams.inert and not _recording():
        return _NO_LABEL
    return _Stage(streams, name, index, stream)


class _Stage:
    """A stage with work to do on entry: a label, a stream, a checking hook. A class, not a
    generator: entering it costs one small object, no generator frame."""

    __slots__ = ("_index", "_label", "_name", "_stream", "_streams", "_use")

    def __init__(self, streams: Streams, name: str, index: int, stream: Any = None) -> None:
        self._streams, self._name, self._index, self._stream = streams, name, index, stream
        self._label: Any = None
        self._use: Any = None

    def __enter__(self) -> None:
        if _recording():
            self._label = record_function(f"pipeline::{self._name}#{self._index}")
            self._label.__enter__()
        self._use = self._streams.use(self._stream)
        self._use.__enter__()
        self._streams.stage_started(self._name)

    def __exit__(self, *exc: object) -> None:
        try:
            self._use.__exit__(*exc)
        finally:
            if self._label is not None:
                self._label.__exit__(*exc)


# -- KeepAlive ---------------------------------------------------------------------------------------


class KeepAlive:
    """Objects handed to consumer streams, held until an event each consumer recorded after its
    last use has completed.

    Args:
        new_event: makes an event with `record(stream)`, `query()` and `synchronize()`
            (`torch.cuda.Event`, or a test double's). Completed events are reused.
        log: called with `("hold" | "release" | "drop", obj, consumer[, event])` for each object,
            by a checking test double; None on the hot path.
    """

    def __init__(self, new_event: Callable[[], Any], log: Callable[[tuple], None] | None = None) -> None:
        self._new_event = new_event
        self._log = log
        self._held: dict[Hashable, list[tuple[Any, Any]]] = {}
        """Owner -> (object, consumer stream) for each hold not released yet."""
        self._released: dict[Any, deque[tuple[Any, list[Any]]]] = {}
        """Consumer stream -> (its event, the objects it covers), in the order recorded."""
        self._spare: list[Any] = []
        self._waiting = 0
        """Events recorded and not yet seen completed (0: `poll` has nothing to query)."""
        self.size = 0
        """Objects held now (released or not)."""
        self.peak = 0
        """The most objects held at once."""

    def hold(self, obj: Any, consumer: Any, owner: Hashable) -> None:
        """Keep `obj`, which stream `consumer` will read, until `owner` is released and the
        consumer's event then has completed. Drops what completed so far first."""
        if self._waiting:
            self.poll()
        self._held.setdefault(owner, []).append((obj, consumer))
        self.size += 1
        self.peak = max(self.peak, self.size)
        if self._log is not None:
            self._log(("hold", obj, consumer))

    def release(self, owner: Hashable) -> None:
        """Every consumer of `owner`'s objects has queued its last use: record an event on each
        (now, on the host) and drop the objects once it has completed. Drops what completed so
        far first."""
        self.poll()
        holds = self._held.pop(owner, None)
        if not holds:
            return
        by_stream: dict[Any, list[Any]] = {}
        for obj, consumer in holds:
            by_stream.setdefault(consumer, []).append(obj)
        for consumer, objs in by_stream.items():
            event = self._spare.pop() if self._spare else self._new_event()
            event.record(consumer)
            self._released.setdefault(consumer, deque()).append((event, objs))
            self._waiting += 1
            if self._log is not None:
                for obj in objs:
                    self._log(("release", obj, consumer, event))

    def poll(self) -> None:
        """Drop the objects whose consumer's event has completed (queries only; never blocks)."""
        if not self._waiting:
            return
        for consumer, queue in self._released.items():
            while queue and queue[0][0].query():
                self._drop(consumer, *queue.popleft())

    def wait(self) -> None:
        """Wait for every released object's event and drop it; held ones stay (their batches are
        still in flight)."""
        for consumer, queue in self._released.items():
            while queue:
                event, objs = queue.popleft()
                event.synchronize()
                self._drop(consumer, event, objs)

    def release_all(self) -> None:
        """Release every owner now and wait: nothing is kept afterwards (a reset drops every
        batch in flight)."""
        for owner in list(self._held):
            self.release(owner)
        self.wait()

    def _drop(self, consumer: Any, event: Any, objs: list[Any]) -> None:
        self._waiting -= 1
        self.size -= len(objs)
        self._spare.append(event)
        if self._log is not None:
            for obj in objs:
                self._log(("drop", obj, consumer))


# -- CUDA --------------------------------------------------------------------------------------------


class CudaStreams(OrderedStreams):
    """Side streams on a CUDA device; copy and communication at high priority.

    Args:
        device: the CUDA device.
        prefetch: make a prefetch stream.
        data_dist: make a data_dist stream; without, input_dist runs on the caller's stream (no
            memory pool of another stream).
        handoff: one of `HANDOFFS` ("record-stream" is there to compare the two in-flight memories).
    """

    def __init__(
        self,
        device: torch.device,
        *,
        prefetch: bool = True,
        data_dist: bool = True,
        handoff: str = "keep-alive",
    ) -> None:
        super().__init__(torch.cuda.Event, handoff=handoff)
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

    def free_after(self, tensor: Any, stream: Any) -> None:
        _record_stream(tensor, stream)


def _record_stream(obj: Any, stream: Any) -> None:
    if isinstance(obj, torch.Tensor):
        if obj.is_cuda:
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


# -- CPU, with the prefetch stream a worker thread ---------------------------------------------------


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

    def close(self) -> None:
        """End the thread (after what was submitted); a later `submit` starts a new one."""
        self.discard()
        self._executor.shutdown(wait=True)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"pipeline-{self.name}")


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

    def close(self) -> None:
        self.prefetch.close()
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
