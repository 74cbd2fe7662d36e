"""A store file's layout (`tiered.store`): a 4 KiB header (a magic line, then the shape as JSON),
then the weights `[rows, dim]` and the optimizer state `[rows, state_width]`, two float32 regions
each starting on a page. Writing a new file, and checking an existing one before it is used.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

from tiered.pages import StoreError

__all__ = ["HEADER", "check_directory", "check_header", "offsets", "write_file"]

MAGIC = b"TIEREDSTORE1\n"
HEADER = 4096
"""Bytes of the header: where the weights start."""
_ALIGN = 4096
_CHUNK_BYTES = 64 << 20  # initialisation writes at most this much at a time


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def offsets(rows: int, dim: int, state_width: int) -> tuple[int, int, int]:
    """Where the weights and the state start in a store of this shape, and the file's size."""
    state = _align(HEADER + rows * dim * 4)
    return HEADER, state, _align(state + rows * state_width * 4)


def write_file(
    path: Path, rows: int, dim: int, state_width: int, init: Callable[[torch.Tensor], None]
) -> None:
    """Write a new store file at `path`: the header, the weights filled chunk by chunk by
    `init(tensor)`, the state zeroed. Written under a temporary name and renamed into place, so an
    interruption never leaves a half-written store at `path`.

    Raises:
        StoreError: the directory is missing or not writable, or `path` holds a store made for
            another shape.
    """
    check_directory(path.parent)
    if path.exists():
        check_header(path, rows, dim, state_width)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            header = json.dumps({"rows": rows, "dim": dim, "state_width": state_width, "dtype": "f32"})
            f.write(MAGIC + header.encode().ljust(HEADER - len(MAGIC), b" "))
            chunk = max(1, _CHUNK_BYTES // (4 * max(dim, 1)))
            for start in range(0, rows, chunk):
                block = torch.empty(min(chunk, rows - start), dim)
                init(block)
                f.write(block.numpy().tobytes())
            f.truncate(offsets(rows, dim, state_width)[2])
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def check_directory(directory: Path) -> None:
    if not directory.is_dir():
        raise StoreError(f"embedding store directory {directory} does not exist; create it or pick another")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise StoreError(f"embedding store directory {directory} is not writable; pick a writable one")


def check_header(path: Path, rows: int, dim: int, state_width: int) -> None:
    with open(path, "rb") as f:
        head = f.read(HEADER)
    if not head.startswith(MAGIC):
        raise StoreError(f"{path} is not an embedding store; delete it or pick another directory")
    found = json.loads(head[len(MAGIC) :].decode().strip())
    want = {"rows": rows, "dim": dim, "state_width": state_width}
    got = {k: found.get(k) for k in want}
    if got != want:
        raise StoreError(
            f"{path} was made for another table shape ({got}, this table needs {want}); "
            "delete it or pick another store directory"
        )
