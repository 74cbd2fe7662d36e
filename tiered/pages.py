"""Row I/O on a store file in runs of whole pages: the part of `tiered.store` that talks to the disk.

`Pages` reads and writes rows of the two float32 regions of a store file (weights, optimizer state)
without mapping the file; `_spans` groups sorted ids into runs that one system call covers.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

__all__ = ["Pages", "StoreError"]

_PAGE = 4096
_RUN_PAGES = 64  # one preadv/pwritev covers at most this many pages


class StoreError(RuntimeError):
    """The store file cannot be created or opened as asked; the message says what to do."""


class Pages:
    """Row I/O on the store file in runs of whole pages.

    Every page a call needs is asked for first (`posix_fadvise(WILLNEED)`: the reads are issued at
    once and proceed in parallel on the device), then each run of pages is read with one `preadv`
    (which waits with the GIL released) into a staging buffer; rows are gathered from it, or
    scattered into it and the runs written back whole with `pwritev` (so the kernel never has to
    read a page in the middle of a write). Not through a mapping: a fault there also maps the page's
    cached neighbours (the kernel's fault-around), which would count most of a table in the resident
    set. Writes must come from one thread (the store's writer): two writers could lose each other's
    rows of a shared page.
    """

    def __init__(self, fd: int, w_off: int, s_off: int) -> None:
        self._fd = fd
        self._regions = (w_off, s_off)

    def gather(
        self, rows: np.ndarray, dim: int, state_width: int, *, drop: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        """Copies of `rows` of both regions; `drop` also evicts their pages from the page cache."""
        out = []
        for region, width in zip(self._regions, (dim, state_width), strict=True):
            if width == 0 or len(rows) == 0:
                out.append(np.zeros((len(rows), width), dtype=np.float32))
                continue
            staging, runs, first = self._load(rows, region, width)
            out.append(_rows(staging, width)[first])
            self._drop(runs, drop)
        return out[0], out[1]

    def scatter(self, rows: np.ndarray, weights: np.ndarray, state: np.ndarray, *, drop: bool) -> None:
        """Write `weights`/`state` into `rows` of both regions; `drop` also starts the pages'
        write-back and evicts them from the page cache once clean."""
        for region, values in zip(self._regions, (weights, state), strict=True):
            if values.shape[1] == 0 or len(rows) == 0:
                continue
            staging, runs, first = self._load(rows, region, values.shape[1])
            _rows(staging, values.shape[1], writeable=True)[first] = values
            for start, length, offset in runs:
                self._io(os.pwritev, staging[offset : offset + length], start)
            self._drop(runs, drop)

    def _load(self, ids: np.ndarray, region: int, width: int) -> tuple[np.ndarray, list, np.ndarray]:
        """The runs of pages holding `ids`' rows read into a staging buffer: (buffer, [(file byte,
        length, buffer byte)], the float index in the buffer where each row starts)."""
        row_bytes = width * 4
        byte = region + ids.astype(np.int64) * row_bytes
        pages = np.unique(np.concatenate([byte // _PAGE, (byte + row_bytes - 1) // _PAGE]))
        spans = _spans(pages, max_gap=1, max_rows=_RUN_PAGES)
        starts = np.array([int(pages[a]) * _PAGE for a, _ in spans], dtype=np.int64)
        lengths = np.array(
            [(int(pages[b - 1]) - int(pages[a]) + 1) * _PAGE for a, b in spans], dtype=np.int64
        )
        offsets = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
        runs = list(zip(starts.tolist(), lengths.tolist(), offsets.tolist(), strict=True))
        for start, length, _ in runs:
            os.posix_fadvise(self._fd, start, length, os.POSIX_FADV_WILLNEED)
        staging = np.empty(int(lengths.sum()), dtype=np.uint8)
        for start, length, offset in runs:
            self._io(os.preadv, staging[offset : offset + length], start)
        run = np.searchsorted(starts, byte, side="right") - 1
        first = (offsets[run] + byte - starts[run]) // 4  # runs are page-aligned, rows float-aligned
        return staging, runs, first

    def _io(self, call: Callable, block: np.ndarray, offset: int) -> None:
        done = call(self._fd, [memoryview(block)], offset)
        if done != len(block):
            raise StoreError(f"short I/O on the store at byte {offset}: {done} of {len(block)} bytes")

    def _drop(self, runs: list, drop: bool) -> None:
        """Evict the pages of `runs` with one call over the range they span (a call per run was
        most of a cold read's CPU): the other pages there are ones the store dropped already, or
        another thread's, read again from the disk if dropped before their read."""
        if drop and runs:
            start, (last, length, _) = runs[0][0], runs[-1]
            os.posix_fadvise(self._fd, start, last + length - start, os.POSIX_FADV_DONTNEED)


def _rows(staging: np.ndarray, width: int, *, writeable: bool = False) -> np.ndarray:
    """`[k, width]` view of the staging buffer whose row k starts at float k (no copy): indexed by
    where rows start, one index per row instead of one per float (a `[n, width]` int64 index array
    was 8 bytes built and read per float moved)."""
    return np.lib.stride_tricks.sliding_window_view(staging.view(np.float32), width, writeable=writeable)


def _spans(ids: np.ndarray, *, max_gap: int, max_rows: int) -> list[tuple[int, int]]:
    """`[a, b)` ranges of sorted unique `ids` to read with one call each: neighbours at most
    `max_gap` rows apart share a call, and no call covers more than `max_rows` rows."""
    if len(ids) == 0:
        return []
    breaks = np.flatnonzero(np.diff(ids) > max_gap) + 1
    spans = []
    starts, ends = np.concatenate(([0], breaks)).tolist(), np.concatenate((breaks, [len(ids)])).tolist()
    for a, b in zip(starts, ends, strict=True):
        while ids[b - 1] - ids[a] + 1 > max_rows:
            cut = a + int(np.searchsorted(ids[a:b], ids[a] + max_rows))
            spans.append((a, cut))
            a = cut
        spans.append((a, b))
    return spans
