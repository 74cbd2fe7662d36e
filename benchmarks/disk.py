"""What a read from disk costs on this machine, measured where the stores live, so that a figure
with tables on disk is read with its machine: 4 KiB reads at random offsets of a file just written
and dropped from the page cache (as the benchmarks' cold stores are), wall time and this process's
CPU time per read, medians."""

from __future__ import annotations

import os
import random
import statistics
import time

__all__ = ["read_cost", "read_cost_line"]

_PAGE = 4096


def read_cost(directory: str, *, megabytes: int = 64, reads: int = 2000, seed: int = 0) -> dict[str, float]:
    """`wall_us` and `cpu_us` per 4 KiB read (medians over `reads` reads of one cold file)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f".read-cost-{os.getpid()}")
    pages = megabytes * (1 << 20) // _PAGE
    try:
        with open(path, "wb") as f:
            block = os.urandom(1 << 20)
            for _ in range(megabytes):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold, as the stores are
            offsets = random.Random(seed).sample(range(pages), min(reads, pages))
            wall, cpu = [], []
            for page in offsets:
                w, c = time.perf_counter(), time.process_time()
                os.pread(fd, _PAGE, page * _PAGE)
                cpu.append(time.process_time() - c)
                wall.append(time.perf_counter() - w)
        finally:
            os.close(fd)
    finally:
        if os.path.exists(path):
            os.remove(path)
    return {"wall_us": statistics.median(wall) * 1e6, "cpu_us": statistics.median(cpu) * 1e6}


def read_cost_line(directory: str) -> str:
    """One line for a report's notes."""
    cost = read_cost(directory)
    return (
        f"Disk, measured at the start in the stores' folder: a cold 4 KiB read at a random offset takes "
        f"{cost['wall_us']:.0f} us ({cost['cpu_us']:.0f} us of CPU), median of 2,000."
    )
