"""The one thread per process that writes every store's queued rows behind (`tiered.store`).

A thread per store had put as many writers as table shards on a rank (4 at 2 ranks of the `tiered`
benchmark, 8 at 1 rank) beside the training thread and the prefetch worker: on cores the ranks
already fill, each one more runnable thread to schedule and one more taker of the GIL after each of
its system calls. Measured on 4 stores of 1 M rows, one reader and cold reads: 11.3 us of process
CPU per row read or written with a writer per store, 10.1 with one (docs/tiered.md, "Why the
pipelines cost more CPU at 2 ranks"). One writer also keeps every store's writes in one order,
which is all a store needs (its own writes in order), and never leaks a thread per store built.

The thread is started on first use, and again in a forked child (which inherits no threads). It
is not a daemon: queued rows are written before the interpreter exits.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

__all__ = ["submit_write"]

_executor: ThreadPoolExecutor | None = None
_pid = -1
_lock = threading.Lock()


def submit_write(work: Callable[[], None]) -> Future:
    """Run `work` on the process's writer thread, after every write submitted before it."""
    global _executor, _pid
    if _executor is None or _pid != os.getpid():
        with _lock:
            if _executor is None or _pid != os.getpid():
                _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiered-writer")
                _pid = os.getpid()
    return _executor.submit(work)
