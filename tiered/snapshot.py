"""Tables on disk in a checkpoint: copy each store file into (and back out of) a checkpoint
directory by streaming, and hash them, without ever holding a table in RAM.

A store file already is the table shard's checkpoint format (header, weights, optimizer state), so
a checkpoint takes a copy of the file after the cache's dirty rows are written back. The copy runs
in the kernel (`os.copy_file_range`; 16 MiB reads and writes where the file system refuses it), so
the process's resident memory does not grow with the table, unlike a `state_dict()` of the mapped
regions, whose pages count in the resident set once read. The copies are per rank and per shard: a
checkpoint restores onto the same sharding only (the file names say rank, rows and columns).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

from tiered.kernel import TieredEmbeddingBag
from tiered.layout import HEADER
from tiered.pages import StoreError

__all__ = ["digest_stores", "load_stores", "save_stores"]

_CHUNK = 16 << 20


def save_stores(kernels: Iterable[TieredEmbeddingBag], directory: str | os.PathLike) -> list[str]:
    """Write back every dirty cached row, then copy each store file into `directory` (fsynced).

    Returns:
        The names of the files written.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    names = []
    for kernel in kernels:
        kernel.flush()
        for cache in kernel.caches:
            target = directory / cache.store.path.name
            _copy(cache.store.path, target)
            names.append(target.name)
    return names


def load_stores(kernels: Iterable[TieredEmbeddingBag], directory: str | os.PathLike) -> None:
    """Overwrite each store with its copy in `directory` and drop the caches' rows.

    Raises:
        StoreError: a copy is missing (the checkpoint was taken with another sharding or world
            size) or was made for another table shape.
    """
    directory = Path(directory)
    for kernel in kernels:
        kernel.flush()  # queued write-backs must not land on top of the restored rows
        for cache in kernel.caches:
            source = directory / cache.store.path.name
            if not source.exists():
                raise StoreError(
                    f"the checkpoint has no copy of table shard {cache.store.path.name}: it was saved "
                    "with another sharding or world size, which tables on disk cannot be resumed onto"
                )
            if _header(source) != _header(cache.store.path):
                raise StoreError(f"{source} was made for another table shape than {cache.store.path}")
            _copy(source, cache.store.path)
        kernel.purge()


def digest_stores(kernels: Iterable[TieredEmbeddingBag]) -> list[tuple[str, str]]:
    """(file name, blake2b of its contents) of every store, after writing back dirty rows; reads
    the files in 16 MiB chunks."""
    found = []
    for kernel in kernels:
        kernel.flush()
        for cache in kernel.caches:
            digest = hashlib.blake2b(digest_size=16)
            buffer = bytearray(_CHUNK)
            with open(cache.store.path, "rb", buffering=0) as f:
                while n := f.readinto(buffer):
                    digest.update(memoryview(buffer)[:n])
            found.append((cache.store.path.name, digest.hexdigest()))
    return found


def _header(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(HEADER)


def _copy(source: Path, target: Path) -> None:
    """Copy `source` over `target` in place (same size: a store file is never truncated while
    open), then fsync it."""
    size = source.stat().st_size
    with open(source, "rb") as src, open(target, "r+b" if target.exists() else "wb") as dst:
        offset = 0
        try:
            while offset < size:
                done = os.copy_file_range(src.fileno(), dst.fileno(), size - offset, offset, offset)
                if done == 0:
                    break
                offset += done
        except OSError:  # no in-kernel copy between these file systems: stream through a buffer
            pass
        src.seek(offset)
        dst.seek(offset)
        buffer = bytearray(_CHUNK)
        while n := src.readinto(buffer):
            dst.write(memoryview(buffer)[:n])
        dst.truncate(size)
        os.fsync(dst.fileno())
