"""Streams and every cross-stream hand-off, in one place (docs/reference.md, "Streams and hand-offs"):
`Streams` (CPU: no-ops), `OrderedStreams` with `CudaStreams`, `ThreadStreams` (CPU, the prefetch
stream a worker thread), `KeepAlive`, and the stages' profiler labels (`run_stage`, `label`:
`pipeline::<stage>#<batch index>`, what the timeline tool reads), made only while a profiler
records: a `record_function` costs 8-15 us even with none running."""

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
    "NO_LABEL",
    "CudaStreams",
    "KeepAlive",
    "OrderedStreams",
    "Streams",
    "ThreadStreams",
    "all_threads_profiled",
    "label",
    "profiling",
    "profiling_all_threads",
    "run_stage",
    "streams_for",
]


HANDOFFS = ("keep-alive", "record-stream")
"""How a hand-off keeps memory alive: "keep-alive" (`KeepAlive`) or "record-stream"
(`Tensor.record_stream` on the consumer, kept to measure the difference)."""


class Streams:
    """No streams (CPU): stages run in program order on the calling thread."""

    memcpy: Any = None
    data_dist: Any = None
    prefetch: Any = None
    in_order: bool = True
    """No device streams: copy, input_dist and compute run in program order on the calling thread,
    so their hand-offs, `use()` and `stage_started()` have nothing to order and, with no profiler
    recording, a stage needs no bookkeeping (`run_stage`). A prefetch worker thread (`ThreadStreams`)
    orders its own hand-offs, which are not skipped."""

    def current(self) -> Any:
        """The stream the caller is running on now (forward/backward/optimizer run there)."""
        return None

    def use(self, stream: Any):
        return nullcontext()

    def record(self, obj: Any, stream: Any) -> None:
        """`record_stream(stream)` on every tensor of `obj`."""

    def free_after(self, tensor: Any, stream: Any) -> None:
        """`tensor`'s storage is freed next while `stream` still reads it (a stash's copy): its block is
        not reused before `stream`'s work so far is done (`record_stream`, under either hand-off)."""

    def produced(self, obj: Any) -> None:
        """`obj` was just created on the current stream (a checking hook; no-op here)."""

    def consumed(self, obj: Any) -> None:
        """`obj` is about to be read on the current stream (a checking hook; no-op here)."""

    def stage_started(self, name: str) -> None:
        """Stage `name` starts on the current stream (a checking hook; no-op here)."""

    @property
    def has_prefetch_worker(self) -> bool:
        """Whether the prefetch stream is a worker thread (`ThreadStreams`)."""
        return isinstance(self.prefetch, _WorkerStream)

    @property
    def prefetch_on_worker(self) -> bool:
        """Whether work submitted to the prefetch stream now runs on a worker thread."""
        return False

    def set_prefetch_on_worker(self, enabled: bool) -> None:
        """Run prefetch-stream work on the worker thread (True) or inline (False); no-op without one."""

    def submit(self, stream: Any, work: Callable[[], None]) -> Future:
        """Run `work` on `stream` (on a worker stream later, in order); the future's `result()` waits."""
        done: Future = Future()
        with self.use(stream):
            work()
        done.set_result(None)
        return done

    def wait_all(self) -> None:
        """Wait for all work submitted so far and the streams' last uses of what was released (a detach, a
        checkpoint), holding what batches in flight hold; raises the first error no hand-off raised yet."""

    def discard(self) -> None:
        """Wait for all work submitted so far, dropping its errors; release everything held (a reset)."""

    def close(self) -> None:
        """`discard`, then end the threads the streams run on (their pipeline's `close()`)."""
        self.discard()

    def handoff(self, obj: Any, producer: Any, owner: Hashable | None = None) -> None:
        """Make `obj`, produced on stream `producer`, usable on the current stream: the current stream
        waits for `producer`'s work so far and `obj` is held until `release(owner)`. Call after `obj` is
        produced, before the current stream first uses it; `obj` None: only the order (a fence)."""

    def handoff_event(self, obj: Any, event: Any, consumer: Any, owner: Hashable | None = None) -> None:
        """`handoff` where the producer recorded `event` (None: none, or on the host): `consumer`
        waits for the event, and `obj` is held for it until `release(owner)`."""

    def event(self, stream: Any) -> Any:
        """An event recorded now on `stream`, for `handoff_event` (None without streams)."""
        return None

    def release(self, owner: Hashable) -> None:
        """`owner`'s consumer streams have queued their last use (its batch's end: after backward, where
        autograd reads what forward saved; or its drop): each records an event; the objects go after it."""

    def returned(self, obj: Any) -> None:
        """`obj` leaves the pipeline for the caller, who reads it on the current stream past any point
        the pipeline can order: its tensors are recorded on that stream."""

    def poll(self) -> None:
        """Drop what the streams are done with (queries only), before a step allocates."""

    @property
    def kept(self) -> int:
        """Objects held for a consumer stream now (0 without streams)."""
        return 0


class OrderedStreams(Streams):
    """The hand-off of real or fake streams: a wait, then the object held (`KeepAlive`) or, under
    "record-stream", recorded; subclasses supply the streams and `record`. `new_event` makes an event
    (`record`, `wait`, `query`, `synchronize`); `log` is a checking test double's (`KeepAlive`)."""

    in_order = False

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
        # the caller may read parts of a batch (labels) past the step: memory another stream allocated
        # must wait for the caller's stream at its free, which only record_stream can say
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


NO_LABEL = nullcontext()
"""The shared no-op that `label` and `run_stage` give where nothing is to be labelled or ordered."""


def profiling() -> bool:
    """A profiler records (labels are worth their cost)."""
    return _profiler_enabled() or autograd_profiler._is_profiler_enabled


def label(text: str) -> Any:
    """A context manager labelling the enclosed work `text` while a profiler records (else a no-op)."""
    return record_function(text) if profiling() else NO_LABEL


def run_stage(streams: Streams, name: str, index: int, stream: Any = None) -> Any:
    """A context manager running the enclosed work as stage `name` of batch `index` on `stream`
    (None: the current one); with streams in order and no profiler, a shared no-op."""
    if streams.in_order and not profiling():
        return NO_LABEL
    return _Stage(streams, name, index, stream)


class _Stage:
    """A stage with work on entry (a label, a stream, a check); a class costs no generator frame."""

    __slots__ = ("_index", "_label", "_name", "_stream", "_streams", "_use")

    def __init__(self, streams: Streams, name: str, index: int, stream: Any = None) -> None:
        self._streams, self._name, self._index, self._stream = streams, name, index, stream
        self._label: Any = None
        self._use: Any = None

    def __enter__(self) -> None:
        if profiling():
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


class KeepAlive:
    """Objects handed to consumer streams, held until an event each consumer recorded after its last
    use has completed. `new_event` makes an event (`record`, `query`, `synchronize`), reused once done;
    `log` gets each `("hold" | "release" | "drop", obj, consumer[, event])` (a checking test double)."""

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
        """Keep `obj` for stream `consumer` until `owner` is released and that event completed."""
        if self._waiting:
            self.poll()
        self._held.setdefault(owner, []).append((obj, consumer))
        self.size += 1
        self.peak = max(self.peak, self.size)
        if self._log is not None:
            self._log(("hold", obj, consumer))

    def release(self, owner: Hashable) -> None:
        """Record an event now on each consumer of `owner`'s objects; they go once it completed."""
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
        """Wait for every released object's event and drop it; held ones stay (batches in flight)."""
        for consumer, queue in self._released.items():
            while queue:
                event, objs = queue.popleft()
                event.synchronize()
                self._drop(consumer, event, objs)

    def release_all(self) -> None:
        """Release every owner and wait: nothing is kept afterwards (a reset)."""
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


class CudaStreams(OrderedStreams):
    """Side streams on a CUDA device, copy and communication at high priority (without `data_dist`,
    input_dist runs on the caller's stream); `handoff` is one of `HANDOFFS`."""

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


_all_threads_profiled = False


@contextmanager
def profiling_all_threads() -> Iterator[None]:
    """Declare that the active torch.profiler records every thread (made with
    `_ExperimentalConfig(profile_all_threads=True)`): inside it `ThreadStreams` keeps the prefetch stage
    on its worker while profiling; outside, the stage runs inline then, or its events would be lost."""
    global _all_threads_profiled
    previous, _all_threads_profiled = _all_threads_profiled, True
    try:
        yield
    finally:
        _all_threads_profiled = previous


def all_threads_profiled() -> bool:
    return _all_threads_profiled


class _WorkerStream:
    """A thread that runs submitted work in order: the CPU stand-in for a CUDA side stream."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"pipeline-{name}")
        self._pending: deque[Future] = deque()
        """Work submitted since the last `wait_all` or `discard`, less what finished without error
        (dropped at each submission: a run submits a job a step, for days)."""
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
        pending.append(job)
        return job

    @property
    def job(self) -> Future | None:
        """On the worker thread, the future of the work it is running; else None."""
        return getattr(self._local, "job", None)

    def join(self) -> None:
        """Wait for everything submitted so far; re-raises the error of the last work (the last is
        pending unless it, and so all before it, finished without error)."""
        if self._pending:
            self._pending[-1].result()

    def wait_all(self) -> None:
        """Wait for everything submitted so far; re-raise the first error among it."""
        pending = self._pending
        self.discard()
        for job in pending:
            if job.exception() is not None:
                raise job.exception()

    def discard(self) -> None:
        """Wait for everything submitted so far and forget its errors."""
        pending, self._pending = self._pending, deque()
        wait(pending)

    def close(self) -> None:
        """End the thread (after what was submitted); a later `submit` starts a new one."""
        self.discard()
        self._executor.shutdown(wait=True)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"pipeline-{self.name}")


class ThreadStreams(Streams):
    """CPU streams whose prefetch stream is a worker thread; a hand-off of what the worker produced
    waits for the job that produced it (anything else: for all), as `wait_stream` does on CUDA."""

    def __init__(self) -> None:
        self.prefetch = _WorkerStream("prefetch")
        self._threaded = True  # False: work submitted to the prefetch stream runs inline
        self._made_by: dict[int, Future] = {}  # id of an object the worker produced -> its job

    def set_prefetch_on_worker(self, enabled: bool) -> None:
        self._threaded = enabled

    @property
    def prefetch_on_worker(self) -> bool:
        # a profiler records only the threads it started on: while it runs, stages stay on this one
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
        # only the job that made `obj`: the prefetch of i+1 may already run as forward of i reads i's
        if isinstance(producer, _WorkerStream):
            job = self._made_by.pop(id(obj), None)
            if job is not None:
                job.result()
            else:
                producer.join()


def streams_for(device: torch.device, *, prefetch_thread: bool = False, data_dist: bool = True) -> Streams:
    """Real streams on CUDA (data_dist only if `data_dist`); on CPU none, or a prefetch worker thread."""
    if device.type == "cuda":
        return CudaStreams(device, data_dist=data_dist)
    if prefetch_thread:
        return ThreadStreams()
    return Streams()
