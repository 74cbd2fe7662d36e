"""Streams and cross-stream hand-offs, in one place (docs/reference.md, "Streams and hand-offs").

A pipeline runs each stage on a stream: the copy on `memcpy`, the input all-to-all on `data_dist`,
the prefetch on `prefetch`, and forward/backward/optimizer on whatever stream the caller runs on
(read at each use, never a stream of our own: work queued elsewhere would not be ordered with the
user's code around `progress()`). Every object made on one stream and used on another goes through
`Streams.handoff`; `release` and `returned` end what it holds (the contract: their docstrings).

Implementations: `Streams` (CPU: no-ops), `cuda_streams.CudaStreams`, `thread_streams.ThreadStreams`
(CPU, the prefetch stream a worker thread) and the test double `tests.streamcheck.RecordingStreams`.
`CudaStreams` and the double share `OrderedStreams`, where the hand-off is written once. Nobody asks
which it has.

`record_stream` remains (`Streams.record`) under `handoff="record-stream"`, for what `returned`
gives the caller, for a storage freed while a side stream still copies it (`free_after`), and inside
torchrec's and fbgemm's APIs: a collective's awaitable records its result on the stream that waits
for it (`torchrec.distributed.comm_ops.Request`), a UVM-caching table's `prefetch(...,
forward_stream)` its cache locations on the forward stream.

Stages run under profiler labels (`run_stage`, `label`), paid for only while a profiler records: a
stage (copy, input_dist::start, ..., optimizer: the names `timeline.trace.STAGES` reads) runs under
`record_function("pipeline::<stage>#<batch index>")`, e.g. `pipeline::forward#12`, which the
timeline tool reads. A `record_function` costs 8-15 us of host time even with no profiler running,
so labels are made only while one records (a check of ~0.1 us). torch 2.13's `_profiler_enabled()`
says False under a profiler made with `profile_all_threads=True` (the timeline's), so the
Python-side flag that every torch.profiler sets is read too.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from concurrent.futures import Future
from contextlib import nullcontext
from typing import Any

from torch._C._autograd import _profiler_enabled
from torch.autograd import profiler as autograd_profiler
from torch.profiler import record_function

from pipeline.stages.keepalive import KeepAlive

__all__ = [
    "HANDOFFS",
    "OrderedStreams",
    "Streams",
    "label",
    "run_stage",
]

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

    def __exit__(self, *exc: Any) -> None:
        try:
            self._use.__exit__(*exc)
        finally:
            if self._label is not None:
                self._label.__exit__(*exc)
