"""The slow tier: one table shard's rows and optimizer state in a file on local disk.

A store knows row I/O and nothing else: no cache, no torchrec. The file (`tiered.layout`) is a 4 KiB
header (shape and dtype, checked on open), then the weights `[rows, dim]` and the optimizer state
`[rows, state_width]` as two contiguous float32 regions. Rows move in runs of whole pages
(`tiered.pages`): every page a call needs is asked for at once, so the reads proceed in parallel on
the device, then each run is read with one `preadv` (waiting with the GIL released) and the rows
gathered in one vectorized step. Per row that is a few microseconds of CPU, so a prefetch on a
worker thread spends its time waiting on the disk, which is what lets it overlap compute on cores
that are already busy. Nothing is mapped during training, so resident memory stays bounded by the
cache however large the table.

Writes are written behind: `write()` queues a copy of the rows (at most `WRITE_BEHIND` writes, then
it waits for the oldest) and the store's writer thread (`tiered.writer`: one per process where the
ranks fill the cores, a store's writes always on the same one) writes them in order, whole pages;
`read()` of a row still queued returns the queued values, so a prefetch never waits for a
write-back. `sync()` waits for them all; `weights()`/`state()` map the regions as tensors for
checkpoints (after a `sync()`).

Nothing waits on a write that cannot happen. A write is queued only once a writer thread took it:
at interpreter exit (an atexit handler, a `__del__`) the threads take no more, and `write()` raises
instead. A forked child inherits a store's queue but not its writer thread, which writes the
queued rows in the parent: a child that inherited a store with writes queued cannot use it
(`read`, `write`, `sync`, `weights`, `state` raise `StoreError`; `close()` only closes the child's
descriptor, at once); a store inherited with nothing queued works in the child as anywhere.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tiered.layout import check_header, offsets, write_file
from tiered.pages import Pages, StoreError
from tiered.writer import submit_write

__all__ = ["RowStore", "StoreError", "StoreStats"]

_STORES = itertools.count()
_OPEN: weakref.WeakSet[RowStore] = weakref.WeakSet()
"""Every store of this process (a forked child resets their writer state: `_after_fork_in_child`)."""

WRITE_BEHIND = 4
"""Writes queued per store before `write()` waits for the oldest (bounds the RAM they hold)."""


@dataclass(slots=True)
class StoreStats:
    """Cumulative I/O of one store."""

    rows_read: int = 0
    rows_written: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0
    """Time the writer thread spent writing (in the background)."""
    write_wait_seconds: float = 0.0
    """Time callers of `write()`/`sync()` waited for queued writes (the part not hidden)."""


@dataclass(eq=False)
class _Queued:
    """One `write()` not yet on disk: sorted unique rows and their values (copies)."""

    rows: np.ndarray
    weights: np.ndarray
    state: np.ndarray
    done: Future = field(default_factory=Future)


class RowStore:
    """Rows of one table shard on disk.

    Use `RowStore.create` (new file from initial weights) or `RowStore.open` (existing file).

    Args:
        cold: drop the file from the page cache when it is opened, and after every read ask the
            kernel to drop the pages just read (`posix_fadvise(DONTNEED)`), so every read of a row
            goes to the disk. For benchmarks of a table much larger than RAM on a machine that has
            the RAM.
    """

    def __init__(self, path: Path, rows: int, dim: int, state_width: int, *, cold: bool = False) -> None:
        self.path = Path(path)
        self.rows, self.dim, self.state_width = rows, dim, state_width
        self.cold = cold
        self.stats = StoreStats()
        self._w_off, self._s_off, self._size = offsets(rows, dim, state_width)
        self._fd = os.open(self.path, os.O_RDWR)
        self._writer = next(_STORES)  # which writer thread takes this store's writes
        self._maps: dict[str, torch.Tensor] = {}
        self._queued: list[_Queued] = []  # oldest first; an entry leaves once it is on disk
        self._queue_lock = threading.Lock()
        self._write_error: BaseException | None = None
        self._inherited = 0
        """In a forked child: the writes queued in the parent at the fork (the parent writes them)."""
        self._pages = Pages(self._fd, self._w_off, self._s_off)
        _OPEN.add(self)
        if cold:
            self.drop_page_cache()  # a new store's pages are all in the page cache

    # -- creation -----------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        path: str | os.PathLike,
        rows: int,
        dim: int,
        state_width: int,
        init: Callable[[torch.Tensor], None],
        *,
        cold: bool = False,
    ) -> RowStore:
        """Write a new store at `path` with weights filled chunk by chunk by `init(tensor)` and
        the optimizer state zeroed, then open it.

        The file is written under a temporary name and renamed into place, so an interrupted
        creation never leaves a half-written store at `path`. An existing store of the same shape
        is replaced; one of another shape is refused.

        Raises:
            StoreError: the directory is missing or not writable, or `path` holds a store made for
                another shape.
        """
        path = Path(path)
        write_file(path, rows, dim, state_width, init)
        return cls(path, rows, dim, state_width, cold=cold)

    @classmethod
    def open(
        cls, path: str | os.PathLike, rows: int, dim: int, state_width: int, *, cold: bool = False
    ) -> RowStore:
        """Open an existing store, checking that it was made for this shape.

        Raises:
            StoreError: no store at `path`, or one made for another shape.
        """
        path = Path(path)
        if not path.exists():
            raise StoreError(f"no embedding store at {path}; create it first (store_mode='create')")
        check_header(path, rows, dim, state_width)
        return cls(path, rows, dim, state_width, cold=cold)

    # -- row I/O ------------------------------------------------------------------------------

    def read(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Weights `[n, dim]` and state `[n, state_width]` of `rows` (sorted, unique), including
        writes still queued."""
        self._refuse_if_inherited()
        started = time.perf_counter()
        ids = rows.numpy()
        # Taken before the disk read: a queued write that lands during the read may or may not be
        # seen by it, and is then overlaid from this snapshot either way.
        with self._queue_lock:
            queued = list(self._queued)
        weights, state = self._pages.gather(ids, self.dim, self.state_width, drop=self.cold)
        for entry in queued:  # oldest first, so the newest value of a row wins
            _, mine, theirs = np.intersect1d(ids, entry.rows, assume_unique=True, return_indices=True)
            if len(mine):
                weights[mine] = entry.weights[theirs]
                state[mine] = entry.state[theirs]
        nbytes = weights.nbytes + state.nbytes
        self.stats.rows_read += len(ids)
        self.stats.bytes_read += nbytes
        self.stats.read_seconds += time.perf_counter() - started
        return torch.from_numpy(weights), torch.from_numpy(state)

    def write(
        self, rows: torch.Tensor, weights: torch.Tensor, state: torch.Tensor, *, owned: bool = False
    ) -> None:
        """Queue `weights`/`state` of `rows` (sorted, unique) to be written to the file.

        Returns once they are queued (copied, unless `owned`); `read()` sees them at once, the file
        after `sync()`.

        Args:
            owned: the caller hands `weights` and `state` over and never changes them after: they
                are queued as they are (the cache's write-back passes rows it has just gathered
                from its slots; a second copy of every evicted row was CPU for nothing).

        Raises:
            StoreError: an earlier queued write failed (the store is then unusable), or the writer
                threads take no more work (the interpreter is exiting: these rows are not written).
        """
        self._refuse_if_inherited()
        self._raise_write_error()
        keep = np.ascontiguousarray if owned else np.array  # np.array copies, the other only if it must
        entry = _Queued(
            rows.numpy().copy(),
            keep(weights.numpy(), dtype=np.float32),
            keep(state.numpy(), dtype=np.float32),
        )
        # Queued only once a writer took it: an entry whose submit failed would never be done, and
        # `sync()` would wait for it forever. Under the lock, so the writer cannot dequeue it first.
        with self._queue_lock:
            try:
                submit_write(lambda: self._write_queued(entry), self._writer)
            except RuntimeError as e:
                raise StoreError(
                    f"{len(entry.rows)} rows of {self.path} were not written: the writer threads take "
                    f"no more work ({e}). Write back before the interpreter exits (close() the store, "
                    "or flush its cache), not from an atexit handler or a __del__"
                ) from e
            self._queued.append(entry)
            oldest = self._queued[0] if len(self._queued) > WRITE_BEHIND else None
        self.stats.rows_written += len(entry.rows)
        self.stats.bytes_written += entry.weights.nbytes + entry.state.nbytes
        if oldest is not None:
            self._wait(oldest)

    def sync(self) -> None:
        """Wait until every queued write is in the file.

        Raises:
            StoreError: a queued write failed, or this is a forked child that inherited the store
                with writes queued.
        """
        self._refuse_if_inherited()
        with self._queue_lock:
            newest = self._queued[-1] if self._queued else None
        if newest is not None:
            self._wait(newest)  # the store's one writer thread: its newest is written last
        self._raise_write_error()

    def _wait(self, entry: _Queued) -> None:
        started = time.perf_counter()
        entry.done.result()
        self.stats.write_wait_seconds += time.perf_counter() - started
        self._raise_write_error()

    def _write_queued(self, entry: _Queued) -> None:
        """On the writer thread: write `entry`, then drop it from the queue (kept on failure, so
        reads stay right while the error is reported)."""
        started = time.perf_counter()
        try:
            if self._write_error is None:
                self._write_now(entry.rows, entry.weights, entry.state)
                with self._queue_lock:
                    self._queued.remove(entry)
        except BaseException as error:
            self._write_error = error
        finally:
            self.stats.write_seconds += time.perf_counter() - started
            entry.done.set_result(None)

    def _refuse_if_inherited(self) -> None:
        if self._inherited:
            raise StoreError(
                f"{self.path}: this process was forked while {self._inherited} writes of this store "
                "were queued; its parent's writer thread writes them, so the child cannot use the "
                "store it inherited. Open the store again in the child (after the parent's sync()), "
                "or fork before writing"
            )

    def _after_fork_in_child(self) -> None:
        """In a forked child: forget the parent's queue (its writer thread did not come along, so
        nothing in it would ever be done here) and its lock (a parent's thread may have held it)."""
        self._queue_lock = threading.Lock()
        self._inherited, self._queued = len(self._queued), []

    def _raise_write_error(self) -> None:
        if self._write_error is not None:
            raise StoreError(
                f"writing rows back to {self.path} failed ({self._write_error}); the rows still queued "
                "are lost when the process ends: free disk space or fix the file, then restore a checkpoint"
            ) from self._write_error

    def _write_now(self, ids: np.ndarray, w: np.ndarray, s: np.ndarray) -> None:
        self._pages.scatter(ids, w, s, drop=self.cold)

    def drop_page_cache(self) -> None:
        """Write queued rows and dirty pages and drop the whole file from the page cache (cold reads
        after)."""
        self.sync()
        os.fsync(self._fd)
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

    # -- whole-table views (checkpoints) ------------------------------------------------------

    def weights(self) -> torch.Tensor:
        """The weights region as a `[rows, dim]` tensor mapped onto the file (writes go to disk)."""
        return self._map("weights", self._w_off, (self.rows, self.dim))

    def state(self) -> torch.Tensor:
        """The optimizer-state region as a `[rows, state_width]` tensor mapped onto the file."""
        return self._map("state", self._s_off, (self.rows, self.state_width))

    def _map(self, name: str, offset: int, shape: tuple[int, int]) -> torch.Tensor:
        self.sync()  # also refuses a forked child's inherited store with writes queued
        if name not in self._maps:
            if shape[0] * shape[1] == 0:
                self._maps[name] = torch.zeros(shape)
            else:
                array = np.memmap(self.path, dtype=np.float32, mode="r+", offset=offset, shape=shape)
                self._maps[name] = torch.from_numpy(array)
        return self._maps[name]

    def close(self) -> None:
        """Write what is queued and close the file (in a forked child that inherited writes
        queued, only close its descriptor: the parent writes them)."""
        if self._fd >= 0:
            try:
                if not self._inherited:
                    self.sync()
            finally:
                os.close(self._fd)
                self._fd = -1
        self._maps.clear()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def _after_fork_in_child() -> None:
    for store in list(_OPEN):
        store._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
