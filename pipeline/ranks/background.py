"""One daemon thread for short blocking calls that should overlap the training step: a store read
that waits on the network releases the GIL, so the step goes on computing while it is in flight.

A thread per pipeline would leak one per pipeline built; a thread per call costs its start-up
handshake on the training thread (`Thread.start()` waits until the new thread runs). One thread per
process, started on first use (and again after a fork, which keeps no threads), serves every
pipeline in order. It is a daemon: a call blocked on a peer that died must not keep the process
alive at exit.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

__all__ = ["in_background"]

_calls: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
_thread: threading.Thread | None = None
_start_lock = threading.Lock()


def in_background(call: Callable[[], Any]) -> Future:
    """Run `call()` on the background thread, after the calls submitted before it.

    Returns:
        A future of its result; `result()` re-raises what `call` raised.
    """
    global _thread
    if _thread is None or not _thread.is_alive():
        with _start_lock:
            if _thread is None or not _thread.is_alive():
                _thread = threading.Thread(target=_serve, name="trainpipeline-background", daemon=True)
                _thread.start()
    future: Future = Future()
    _calls.put((call, future))
    return future


def _serve() -> None:
    while True:
        call, future = _calls.get()
        try:
            future.set_result(call())
        except BaseException as e:  # handed to whoever waits for the result
            future.set_exception(e)
