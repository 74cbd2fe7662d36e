"""One store's write-behind queue: the rows written to a store (`tiered.store`) and not yet in its
file, oldest first.

`put()` queues a copy of the rows (at most `WRITE_BEHIND` writes, then it waits for the oldest) and
hands the write to the store's writer thread (`tiered.writer`), which writes the queue in order,
whole pages (`tiered.pages`), and drops each entry once it is on disk. A read takes a `snapshot()`
before it reads the file and lays it over what it read (`overlay`), so a row still queued reads
its newest value and a prefetch never waits for a write-back. `sync()` waits for them all.

Nothing waits on a write that cannot happen. A write is queued only once a writer thread took it:
at interpreter exit (an atexit handler, a `__del__`) the threads take no more, and `put()` raises
instead. A forked child inherits a queue but not the writer thread, which writes the queued rows
in the parent: a queue inherited with writes in it refuses every use in the child (`StoreError`),
one inherited empty works there as anywhere. A failed write is kept (its rows stay readable) and
raised at the next `put()` or `sync()`.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from tiered.pages import Pages, StoreError
from tiered.writer import submit_write

__all__ = ["WRITE_BEHIND", "WriteQueue", "overlay"]

WRITE_BEHIND = 4
"""Writes queued per store before `put()` waits for the oldest (bounds the RAM they hold)."""

_KEYS = itertools.count()
_QUEUES: weakref.WeakSet[WriteQueue] = weakref.WeakSet()
"""Every queue of this process (a forked child resets them: `_after_fork_in_child`)."""


class _Stats(Protocol):
    """The store's counters this queue adds to (`tiered.store.StoreStats`)."""

    rows_written: int
    bytes_written: int
    write_seconds: float
    write_wait_seconds: float


@dataclass(eq=False)
class _Queued:
    """One write not yet on disk: sorted unique rows and their values (copies)."""

    rows: np.ndarray
    weights: np.ndarray
    state: np.ndarray
    done: Future = field(default_factory=Future)


def overlay(entries: list[_Queued], ids: np.ndarray, weights: np.ndarray, state: np.ndarray) -> None:
    """Put the queued values of `ids` (sorted, unique) from `entries` (a `snapshot()`) into the rows
    of `weights`/`state` read from the file; the newest value of a row wins."""
    for entry in entries:  # oldest first
        _, mine, theirs = np.intersect1d(ids, entry.rows, assume_unique=True, return_indices=True)
        if len(mine):
            weights[mine] = entry.weights[theirs]
            state[mine] = entry.state[theirs]


class WriteQueue:
    """The writes of the store at `path` not yet in its file, written by `pages` on the store's
    writer thread (`drop`: evict the written pages from the page cache), counted in `stats`."""

    def __init__(self, pages: Pages, path: Path, stats: _Stats, *, drop: bool) -> None:
        self._pages, self._path, self._stats, self._drop = pages, path, stats, drop
        self._writer = next(_KEYS)  # which writer thread takes this store's writes
        self._queued: list[_Queued] = []  # oldest first; an entry leaves once it is on disk
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self.inherited = 0
        """In a forked child: the writes queued in the parent at the fork (the parent writes them)."""
        _QUEUES.add(self)

    def snapshot(self) -> list[_Queued]:
        """The writes queued now, oldest first (for `overlay`). Take it before reading the file: a
        write that lands during the read may or may not be seen by it, and is overlaid either way."""
        self.refuse_if_inherited()
        with self._lock:
            return list(self._queued)

    def put(self, rows: np.ndarray, weights: np.ndarray, state: np.ndarray, *, owned: bool) -> None:
        """Queue `weights`/`state` of `rows` (copied, unless `owned`), then wait for the oldest write
        if more than `WRITE_BEHIND` are queued.

        Raises:
            StoreError: an earlier write failed, this is a forked child that inherited writes, or
                the writer threads take no more work (the interpreter is exiting).
        """
        self.refuse_if_inherited()
        self.raise_error()
        keep = np.ascontiguousarray if owned else np.array  # np.array copies, the other only if it must
        entry = _Queued(rows.copy(), keep(weights, dtype=np.float32), keep(state, dtype=np.float32))
        # Queued only once a writer took it: an entry whose submit failed would never be done, and
        # `sync()` would wait for it forever. Under the lock, so the writer cannot dequeue it first.
        with self._lock:
            try:
                submit_write(lambda: self._write_queued(entry), self._writer)
            except RuntimeError as e:
                raise StoreError(
                    f"{len(entry.rows)} rows of {self._path} were not written: the writer threads take "
                    f"no more work ({e}). Write back before the interpreter exits (close() the store, "
                    "or flush its cache), not from an atexit handler or a __del__"
                ) from e
            self._queued.append(entry)
            oldest = self._queued[0] if len(self._queued) > WRITE_BEHIND else None
        self._stats.rows_written += len(entry.rows)
        self._stats.bytes_written += entry.weights.nbytes + entry.state.nbytes
        if oldest is not None:
            self._wait(oldest)

    def sync(self) -> None:
        """Wait until every queued write is in the file.

        Raises:
            StoreError: a queued write failed, or this is a forked child that inherited writes.
        """
        self.refuse_if_inherited()
        with self._lock:
            newest = self._queued[-1] if self._queued else None
        if newest is not None:
            self._wait(newest)  # the store's one writer thread: its newest is written last
        self.raise_error()

    def _wait(self, entry: _Queued) -> None:
        started = time.perf_counter()
        entry.done.result()
        self._stats.write_wait_seconds += time.perf_counter() - started
        self.raise_error()

    def _write_queued(self, entry: _Queued) -> None:
        """On the writer thread: write `entry`, then drop it from the queue (kept on failure, so
        reads stay right while the error is reported)."""
        started = time.perf_counter()
        try:
            if self._error is None:
                self._write_now(entry.rows, entry.weights, entry.state)
                with self._lock:
                    self._queued.remove(entry)
        except BaseException as error:
            self._error = error
        finally:
            self._stats.write_seconds += time.perf_counter() - started
            entry.done.set_result(None)

    def _write_now(self, ids: np.ndarray, w: np.ndarray, s: np.ndarray) -> None:
        self._pages.scatter(ids, w, s, drop=self._drop)

    def refuse_if_inherited(self) -> None:
        """Raises `StoreError` in a forked child that inherited writes queued."""
        if self.inherited:
            raise StoreError(
                f"{self._path}: this process was forked while {self.inherited} writes of this store "
                "were queued; its parent's writer thread writes them, so the child cannot use the "
                "store it inherited. Open the store again in the child (after the parent's sync()), "
                "or fork before writing"
            )

    def raise_error(self) -> None:
        """Raises `StoreError` if a queued write failed."""
        if self._error is not None:
            raise StoreError(
                f"writing rows back to {self._path} failed ({self._error}); the rows still queued "
                "are lost when the process ends: free disk space or fix the file, then restore a checkpoint"
            ) from self._error

    def _after_fork_in_child(self) -> None:
        """In a forked child: forget the parent's queue (its writer thread did not come along, so
        nothing in it would ever be done here) and its lock (a parent's thread may have held it)."""
        self._lock = threading.Lock()
        self.inherited, self._queued = len(self._queued), []


def _after_fork_in_child() -> None:
    for queue in list(_QUEUES):
        queue._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
