"""Test doubles for the pipelines' streams: `RecordingStreams` runs on CPU with named fake streams and
fake events, logs every stage, wait, hold, release and drop, and (inside `watch()`) every real use of
a handed-off tensor, so that `check()` proves the hand-offs on CPU. CI has no GPU; this is how a
missing wait or an early release is caught there.

The hand-off logic it runs is `OrderedStreams`', the one `CudaStreams` runs: only the streams, the
events and `record` are fakes. A fake event completes `lag` batches after it was recorded (a GPU
running behind the host), so that the keep-alive really holds objects across steps. `broken` makes
one part of the hand-off wrong on purpose, for the negative tests: `check()` must then fail.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from pipeline.stages.streams import OrderedStreams
from tests.streamcheck.storages import storage_address, storages_of

__all__ = ["HandoffError", "RecordingStreams"]


class HandoffError(AssertionError):
    """RecordingStreams found an object used on a stream that did not wait for its producer, used
    after that stream released it, or dropped before the stream's event completed."""


@dataclasses.dataclass(frozen=True, slots=True)
class _FakeStream:
    name: str
    log: list = dataclasses.field(compare=False, repr=False)

    def wait_stream(self, other: _FakeStream) -> None:
        self.log.append(("wait", self.name, other.name))


class _FakeEvent:
    """Completes once `lag` batches ended after it was recorded (`RecordingStreams.release`)."""

    def __init__(self, streams: RecordingStreams, number: int) -> None:
        self._streams, self.number = streams, number
        self._stream: _FakeStream | None = None
        self._at = 0
        self._done = False

    def record(self, stream: _FakeStream) -> None:
        self._stream, self._at, self._done = stream, self._streams.clock, False
        self._streams.log.append(("event", self.number, stream.name))

    @property
    def stream_name(self) -> str:
        """The stream it was recorded on."""
        return self._stream.name

    def wait(self, stream: _FakeStream) -> None:
        self._streams.log.append(("wait", stream.name, self._stream.name))

    def query(self) -> bool:
        if self._streams.broken == "early-drop":
            return True  # claims the consumer is done while it is not
        if not self._done and self._streams.clock >= self._at + self._streams.lag:
            self.synchronize()
        return self._done

    def synchronize(self) -> None:
        if not self._done:
            self._done = True
            self._streams.log.append(("complete", self.number))


class RecordingStreams(OrderedStreams):
    """Fake named streams on CPU that log stages, waits, holds, releases, drops and uses, for `check()`.

    Args:
        lag: batches (`release` calls) after which an event completes.
        handoff: as `CudaStreams`' ("record-stream" logs records instead of holds).
        broken: None, or a deliberately wrong hand-off: "no-wait" (the consumer does not wait for
            the producer), "release-at-handoff" (the consumer releases before it uses the object),
            "early-drop" (the producer drops an object before the consumer's event completed).
    """

    BROKEN = ("no-wait", "release-at-handoff", "early-drop")

    def __init__(self, *, lag: int = 1, handoff: str = "keep-alive", broken: str | None = None) -> None:
        if broken is not None and broken not in self.BROKEN:
            raise ValueError(f"broken must be None or one of {self.BROKEN}; got {broken!r}")
        self.broken = broken
        self.log: list[tuple] = []
        self.lag, self.clock = lag, 0
        self._events = 0
        super().__init__(self._new_event, handoff=handoff, log=self._kept)
        self.default = _FakeStream("default", self.log)
        self.memcpy = _FakeStream("memcpy", self.log)
        self.data_dist = _FakeStream("data_dist", self.log)
        self.prefetch = _FakeStream("prefetch", self.log)
        self._stack = [self.default]
        self._alive: list[Any] = []  # everything logged stays alive: ids and storages stay unique
        self._storages: dict[int, set[int]] = {}  # storage address -> ids of the objects holding it
        self._origin: dict[int, set[str]] = {}  # object id -> the streams that made or handed it
        self._open: dict[tuple[int, str], int] = {}  # (object id, stream) -> holds not released
        self._ever: set[tuple[int, str]] = set()  # held for that stream once
        self._recorded: set[tuple[int, str]] = set()
        self.uses_checked = 0
        """Uses of a handed-off tensor found inside `watch()` and verified."""

    def _new_event(self) -> _FakeEvent:
        self._events += 1
        return _FakeEvent(self, self._events)

    def current(self) -> _FakeStream:
        return self._stack[-1]

    @contextmanager
    def use(self, stream: Any) -> Iterator[None]:
        self._stack.append(stream if stream is not None else self.current())
        try:
            yield
        finally:
            self._stack.pop()

    def handoff(self, obj: Any, producer: Any, owner: Hashable | None = None) -> None:
        if obj is not None and producer is not None:
            self._origin.setdefault(self._id(obj), set()).add(producer.name)
        if self.broken == "no-wait":
            if obj is not None and producer not in (None, self.current()):
                self.keep_alive.hold(obj, self.current(), owner)
            return
        super().handoff(obj, producer, owner)
        if self.broken == "release-at-handoff" and owner is not None:
            self.release(owner)

    def handoff_event(self, obj: Any, event: Any, consumer: Any, owner: Hashable | None = None) -> None:
        if obj is not None and event is not None:
            self._origin.setdefault(self._id(obj), set()).add(event.stream_name)
        if self.broken == "no-wait":
            if obj is not None and event is not None:
                self.keep_alive.hold(obj, consumer, owner)
            return
        super().handoff_event(obj, event, consumer, owner)
        if self.broken == "release-at-handoff" and owner is not None:
            self.release(owner)

    def release(self, owner: Hashable) -> None:
        self.clock += 1  # a batch ended: the fake GPU moves on
        super().release(owner)
        self.log.append(("kept", self.kept))

    def record(self, obj: Any, stream: Any) -> None:
        oid = self._map(obj)
        self._recorded.add((oid, stream.name))
        self.log.append(("record", oid, stream.name))

    def free_after(self, tensor: Any, stream: Any) -> None:
        # the storage is freed next and its address reused: it is logged, not tracked for uses
        self.log.append(("free_after", id(tensor), stream.name))

    def produced(self, obj: Any) -> None:
        oid = self._id(obj)
        self._origin.setdefault(oid, set()).add(self.current().name)
        self.log.append(("produce", oid, self.current().name))

    def consumed(self, obj: Any) -> None:
        self.log.append(("consume", self._id(obj), self.current().name))

    def stage_started(self, name: str) -> None:
        """Log that stage `name` runs on the current stream."""
        self.log.append(("stage", name, self.current().name))

    def _id(self, obj: Any) -> int:
        self._alive.append(obj)
        return id(obj)

    def _map(self, obj: Any) -> int:
        """`obj`'s id, its storages noted as its own (for the uses `watch()` sees)."""
        oid = self._id(obj)
        for address, tensor in storages_of(obj):
            self._alive.append(tensor)
            self._storages.setdefault(address, set()).add(oid)
        return oid

    def _kept(self, entry: tuple) -> None:
        """KeepAlive's report of a hold, release or drop."""
        kind, obj, stream, *event = entry
        key = (self._map(obj) if kind == "hold" else id(obj), stream.name)
        if kind == "hold":
            self._open[key] = self._open.get(key, 0) + 1
            self._ever.add(key)
        elif kind == "release":
            self._open[key] -= 1
        self.log.append((kind, key[0], key[1], *(e.number for e in event)))

    @contextmanager
    def watch(self) -> Iterator[None]:
        """Check every use of a handed-off tensor by the torch ops run inside (autograd's backward
        included): on a stream that made it, or holds it, or recorded it."""
        with _Uses(self):
            yield

    def note_uses(self, args: Any, op: str) -> None:
        """Called by `watch()` for each op: verify the stream of each handed-off tensor it touches."""
        stream = self.current().name
        for arg in tree_flatten(args)[0]:
            if not isinstance(arg, torch.Tensor):
                continue
            oids = self._storages.get(storage_address(arg))
            if not oids:
                continue
            self.uses_checked += 1
            if any(self._may_use(oid, stream) for oid in oids):
                continue
            late = any((oid, stream) in self._ever for oid in oids)
            why = "after its release" if late else "without a hand-off"
            self.log.append(("misuse", stream, why, op))

    def _may_use(self, oid: int, stream: str) -> bool:
        key = (oid, stream)
        return stream in self._origin.get(oid, ()) or self._open.get(key, 0) > 0 or key in self._recorded

    def stage_streams(self) -> dict[str, set[str]]:
        """Stage name -> the streams it ran on."""
        out: dict[str, set[str]] = {}
        for _kind, name, stream in (e for e in self.log if e[0] == "stage"):
            out.setdefault(name, set()).add(stream)
        return out

    def check(self) -> int:
        """Verify the log: every cross-stream use of a produced object had, after it was produced
        and before the use, a wait of the using stream on the producing one and a hold (or a
        record) of the object there; no handed-off tensor was used on a stream after that stream
        released it (`watch()`); no object was dropped before the event of its release completed.

        Returns:
            The number of cross-stream uses verified.

        Raises:
            HandoffError: naming the first offending entry.
        """
        producer: dict[int, tuple[str, int]] = {}
        released: dict[tuple[int, str], int] = {}
        completed: set[int] = set()
        checked = 0
        for pos, entry in enumerate(self.log):
            kind = entry[0]
            if kind == "produce":
                producer[entry[1]] = (entry[2], pos)
            elif kind == "misuse":
                raise HandoffError(f"a handed-off tensor was used on {entry[1]} {entry[2]} (by {entry[3]})")
            elif kind == "release":
                released[entry[1], entry[2]] = entry[3]
            elif kind == "complete":
                completed.add(entry[1])
            elif kind == "drop" and released.get((entry[1], entry[2])) not in completed:
                raise HandoffError(f"an object held for {entry[2]} was dropped before its event completed")
            elif kind == "consume":
                checked += self._check_consume(entry, pos, producer)
        return checked

    def _check_consume(self, entry: tuple, pos: int, producer: dict[int, tuple[str, int]]) -> int:
        _, obj, stream = entry
        if obj not in producer:
            raise HandoffError(f"object {obj} used on {stream} but never produced")
        src, at = producer[obj]
        if src == stream:
            return 0
        window = self.log[at:pos]
        if ("wait", stream, src) not in window:
            raise HandoffError(f"use on {stream} of an object made on {src} without a wait")
        if ("hold", obj, stream) not in window and ("record", obj, stream) not in window:
            raise HandoffError(f"use on {stream} of an object made on {src} without a hold or a record")
        return 1

    def check_drained(self) -> None:
        """After the last batch ended and `wait_all()`: nothing is kept, every hold was released.

        Raises:
            HandoffError: objects are still kept, or a hold was never released.
        """
        unreleased = sorted(stream for (_, stream), n in self._open.items() if n > 0)
        if unreleased:
            raise HandoffError(f"{len(unreleased)} hold(s) never released, on {sorted(set(unreleased))}")
        if self.kept:
            raise HandoffError(f"{self.kept} object(s) kept after every batch ended and wait_all()")


class _Uses(TorchDispatchMode):
    """Reports every op's tensor arguments to `RecordingStreams.note_uses`."""

    def __init__(self, streams: RecordingStreams) -> None:
        super().__init__()
        self._streams = streams

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self._streams.note_uses((args, kwargs), str(func))
        return func(*args, **(kwargs or {}))
