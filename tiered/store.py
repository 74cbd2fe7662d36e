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

Writes are written behind (`tiered.write_queue`): `write()` queues a copy of the rows and returns,
the store's writer thread writes them in order, whole pages, and `read()` of a row still queued
returns the queued value, so a prefetch never waits for a write-back. `sync()` waits for them all;
`weights()`/`state()` map the regions as tensors for checkpoints (after a `sync()`). A forked child
that inherited a store with writes queued cannot use it (`read`, `write`, `sync`, `weights`,
`state` raise `StoreError`; `close()` only closes the child's descriptor, at once); a store
inherited with nothing queued works in the child as anywhere.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tiered.layout import check_header, offsets, write_file
from tiered.pages import Pages, StoreError
from tiered.write_queue import WriteQueue, overlay

__all__ = ["RowStore", "StoreError", "StoreStats"]


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
        self._maps: dict[str, torch.Tensor] = {}
        self._pages = Pages(self._fd, self._w_off, self._s_off)
        self._queue = WriteQueue(self._pages, self.path, self.stats, drop=cold)
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
        started = time.perf_counter()
        ids = rows.numpy()
        queued = self._queue.snapshot()  # before the disk read (also refuses an inherited queue)
        weights, state = self._pages.gather(ids, self.dim, self.state_width, drop=self.cold)
        overlay(queued, ids, weights, state)
        self.stats.rows_read += len(ids)
        self.stats.bytes_read += weights.nbytes + state.nbytes
        self.stats.read_seconds += time.perf_counter() - started
        return torch.from_numpy(weights), torch.from_numpy(state)

    def write(
        self, rows: torch.Tensor, weights: torch.Tensor, state: torch.Tensor, *, owned: bool = False
    ) -> None:
        """Queue `weights`/`state` of `rows` (sorted, unique) to be written to the file.

        Returns once they are queued (copied, unless `owned`); `read()` sees them at once, the file
        after `sync()`. At most `tiered.write_queue.WRITE_BEHIND` writes are queued; one more waits
        for the oldest.

        Args:
            owned: the caller hands `weights` and `state` over and never changes them after: they
                are queued as they are (the cache's write-back passes rows it has just gathered
                from its slots; a second copy of every evicted row was CPU for nothing).

        Raises:
            StoreError: an earlier queued write failed (the store is then unusable), the writer
                threads take no more work (the interpreter is exiting: these rows are not written),
                or this is a forked child that inherited the store with writes queued.
        """
        self._queue.put(rows.numpy(), weights.numpy(), state.numpy(), owned=owned)

    def sync(self) -> None:
        """Wait until every queued write is in the file.

        Raises:
            StoreError: a queued write failed, or this is a forked child that inherited the store
                with writes queued.
        """
        self._queue.sync()

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
                if not self._queue.inherited:
                    self.sync()
            finally:
                os.close(self._fd)
                self._fd = -1
        self._maps.clear()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
