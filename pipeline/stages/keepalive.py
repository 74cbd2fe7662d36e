"""`KeepAlive`: what keeps an object handed to another stream alive, by ordering instead of
`record_stream`.

A tensor belongs to the stream that allocated it: once its last Python reference goes, the caching
allocator may give its memory to that stream's next allocation, whatever other streams still have
queued on it. `record_stream` defers the reuse until all the work queued on those streams at the
time of the free has run, an unknown later point. Here the side that handed the object over keeps
a reference instead (FSDP2's way): each consumer stream records an event after its last use of the
object, and the reference is dropped once that event has completed. The memory kept is then what
a consumer has not finished with, and no more. Objects are held per owner (a batch's context);
what completed is dropped at the next hand-off, before the allocations that could reuse it, by
queries that never block (`poll`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["KeepAlive"]


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
