"""Test doubles for the pipelines' streams: `RecordingStreams` runs on CPU with named fake streams
and logs every stage, wait, record and use, so that `check()` can prove that nothing was used on a
stream that had not waited for its producer. CI has no GPU; this is how a missing wait is caught
there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pipeline.stages.streams import Streams

__all__ = ["HandoffError", "RecordingStreams"]


class HandoffError(AssertionError):
    """RecordingStreams found an object used on a stream that did not wait for its producer."""


@dataclasses.dataclass(frozen=True, slots=True)
class _FakeStream:
    name: str
    log: list = dataclasses.field(compare=False, repr=False)

    def wait_stream(self, other: _FakeStream) -> None:
        self.log.append(("wait", self.name, other.name))


class RecordingStreams(Streams):
    """Fake named streams on CPU that log stages, waits, records and uses, for `check()`."""

    inert = False

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self._keep: list[Any] = []  # keeps logged objects alive so their ids stay unique
        self.default = _FakeStream("default", self.log)
        self.memcpy = _FakeStream("memcpy", self.log)
        self.data_dist = _FakeStream("data_dist", self.log)
        self.prefetch = _FakeStream("prefetch", self.log)
        self._stack = [self.default]

    def current(self) -> _FakeStream:
        return self._stack[-1]

    @contextmanager
    def use(self, stream: Any) -> Iterator[None]:
        self._stack.append(stream if stream is not None else self.current())
        try:
            yield
        finally:
            self._stack.pop()

    def record(self, obj: Any, stream: Any) -> None:
        self.log.append(("record", self._id(obj), stream.name))

    def produced(self, obj: Any) -> None:
        self.log.append(("produce", self._id(obj), self.current().name))

    def consumed(self, obj: Any) -> None:
        self.log.append(("consume", self._id(obj), self.current().name))

    def stage_started(self, name: str) -> None:
        """Log that stage `name` runs on the current stream."""
        self.log.append(("stage", name, self.current().name))

    def _id(self, obj: Any) -> int:
        self._keep.append(obj)
        return id(obj)

    def stage_streams(self) -> dict[str, set[str]]:
        """Stage name -> the streams it ran on."""
        out: dict[str, set[str]] = {}
        for _kind, name, stream in (e for e in self.log if e[0] == "stage"):
            out.setdefault(name, set()).add(stream)
        return out

    def check(self) -> int:
        """Verify every use of every produced object.

        A use on the producing stream is always fine. A use on another stream needs, after the
        object was produced and before the use, a wait of the using stream on the producing one,
        and a record of the object on the using stream.

        Returns:
            The number of cross-stream uses verified.

        Raises:
            HandoffError: listing the first offending use.
        """
        producer: dict[int, tuple[str, int]] = {}
        checked = 0
        for pos, entry in enumerate(self.log):
            if entry[0] == "produce":
                producer[entry[1]] = (entry[2], pos)
            elif entry[0] == "consume":
                _, obj, stream = entry
                if obj not in producer:
                    raise HandoffError(f"object {obj} used on {stream} but never produced")
                src, at = producer[obj]
                if src == stream:
                    continue
                window = self.log[at:pos]
                if ("wait", stream, src) not in window:
                    raise HandoffError(f"use on {stream} of an object made on {src} without a wait")
                if ("record", obj, stream) not in window:
                    raise HandoffError(f"use on {stream} of an object made on {src} without a record")
                checked += 1
        return checked
