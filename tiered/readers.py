"""The threads that read a batch's table shards at once (`TieredEmbeddingBag.prefetch`).

A batch's misses are spread over the shards of the tables on a rank (8 at 1 rank of the `tiered`
benchmark). Read one shard after another, a miss costs the kernel's CPU time of a cold read on one
core while another core waits: at one rank on two cores the second core is idle for most of a step
that is all reading. Each shard has its own cache and store, so the shards' reads are independent
and run on `read_threads` threads (`preadv` waits with the GIL released), with results bit for bit
those of one thread.

The default gives each local rank its share of the cores the process may run on: one thread where
the ranks already fill the cores, so nothing is added there. The pool is started on first use, and
again in a forked child, which inherits no threads: its pool and the lock guarding the pool's start
are reset at the fork (a lock another thread held then would stay held in the child forever).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

import torch.distributed as dist
from torchrec.distributed.comm import get_local_size

__all__ = ["default_read_threads", "run_all"]

T = TypeVar("T")
MAX_THREADS = 4

_pool: ThreadPoolExecutor | None = None
_pid = -1
_lock = threading.Lock()


def default_read_threads() -> int:
    """The cores this process may run on, shared among the node's ranks (1 to `MAX_THREADS`)."""
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    local = get_local_size(ranks) if ranks > 1 else 1
    return max(1, min(MAX_THREADS, len(os.sched_getaffinity(0)) // max(local, 1)))


def run_all(calls: Sequence[Callable[[], T]], threads: int) -> list[T]:
    """Each of `calls`' results, in order; on at most `threads` threads of the process's pool (here
    if 1). Every call runs; the first error in the calls' order is raised once all have ended (none
    still reading behind it)."""
    if threads <= 1 or len(calls) <= 1:
        return [call() for call in calls]
    outcomes: list[tuple[bool, object]] = [(False, None)] * len(calls)
    todo = iter(range(len(calls)))  # shared by the workers: each takes the next call (atomic)

    def work() -> None:
        for i in todo:
            try:
                outcomes[i] = (True, calls[i]())
            except BaseException as e:  # raised below, in the calls' order
                outcomes[i] = (False, e)

    wait([_executor().submit(work) for _ in range(min(threads, len(calls)))])
    for ok, value in outcomes:
        if not ok:
            raise value  # type: ignore[misc]
    return [value for _, value in outcomes]  # type: ignore[misc]


def _executor() -> ThreadPoolExecutor:
    """The process's pool of `MAX_THREADS` (threads start as work needs them)."""
    global _pool, _pid
    if _pool is None or _pid != os.getpid():
        with _lock:
            if _pool is None or _pid != os.getpid():
                _pool = ThreadPoolExecutor(max_workers=MAX_THREADS, thread_name_prefix="tiered-reader")
                _pid = os.getpid()
    return _pool


def _after_fork_in_child() -> None:
    """The child has none of the parent's threads: a pool and a lock of its own."""
    global _pool, _pid, _lock
    _pool, _pid, _lock = None, -1, threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
