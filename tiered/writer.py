"""The threads that write every store's queued rows behind (`tiered.write_queue`): as many per
process as the rank's share of the cores (`tiered.readers.default_read_threads`), one where the local
ranks fill them. A store's writes always go to the same thread, so they land in order, which is all a store
needs.

A thread per store had put as many writers as table shards on a rank (4 at 2 ranks of the `tiered`
benchmark, 8 at 1 rank) beside the training thread and the prefetch worker: on cores the ranks
already fill, each one more runnable thread to schedule and one more taker of the GIL after each of
its system calls (docs/tiered.md, "Why the pipelines cost more CPU at 2 ranks"). At one rank on two
cores, where every miss evicts a dirty row, one writer was what bound the step: each write-back reads
its page cold and writes it, and a second thread overlaps those waits.

The threads are started on first use, and again in a forked child (which inherits no threads, and
gets a fresh lock: a parent's thread may have held this one at the fork). They are not daemons:
rows queued before the interpreter exits are written; a write submitted after that (an atexit
handler, a `__del__` at shutdown) is refused, and `submit_write` raises.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from tiered.readers import default_read_threads

__all__ = ["submit_write"]

_executors: list[ThreadPoolExecutor] = []
_pid = -1
_lock = threading.Lock()


def submit_write(work: Callable[[], None], key: int = 0) -> Future:
    """Run `work` on the writer thread of `key` (a store's), after every write submitted there
    before it.

    Raises:
        RuntimeError: the writer threads take no more work (the interpreter is exiting).
    """
    global _executors, _pid
    if not _executors or _pid != os.getpid():
        with _lock:
            if not _executors or _pid != os.getpid():
                _executors = [
                    ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiered-writer")
                    for _ in range(default_read_threads())
                ]
                _pid = os.getpid()
    return _executors[key % len(_executors)].submit(work)


def _after_fork_in_child() -> None:
    global _executors, _pid, _lock
    _executors, _pid, _lock = [], -1, threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
