"""`WaitClock`: how long the pipeline's thread is blocked in a step, for the default schedule's
watch (`pipeline.stages.watch`): the splits wait and the values wait are timed on it while the
watch watches or tries."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["WaitClock"]


class WaitClock:
    """Adds up how long the pipeline's own thread blocks in a step: in `wait(request)` (the input
    all-to-alls' waits) and, used as a context manager around backward, the wall time its thread
    spends off the CPU there (on
    CPU, where torchrec's backward waits for its all-to-alls, which on a shared process group queue
    behind the next batch's input all-to-all). Waits on other threads (a prefetch worker) are not
    the step's."""

    __slots__ = ("_clock", "_cpu", "_started", "idle", "thread", "waited")

    def __init__(self, clock: Callable[[], float], cpu: Callable[[], float] = time.thread_time) -> None:
        self._clock, self._cpu = clock, cpu
        self.waited = 0.0
        """Seconds blocked in the input all-to-alls' waits."""
        self.idle = 0.0
        """Seconds off the CPU within backward."""
        self.thread: int | None = None
        self._started: tuple[float, float] | None = None

    def __enter__(self) -> None:
        if threading.get_ident() == self.thread:
            self._started = (self._clock(), self._cpu())

    def __exit__(self, *exc: Any) -> None:
        if self._started is not None:
            wall, cpu = self._started
            self._started = None
            self.idle += max(0.0, (self._clock() - wall) - (self._cpu() - cpu))

    def wait(self, request: Any) -> Any:
        return self.timed(request.wait)

    def timed(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)`, its wall time added to `waited` where it runs on the pipeline's thread."""
        if threading.get_ident() != self.thread:
            return fn(*args)
        start = self._clock()
        try:
            return fn(*args)
        finally:
            self.waited += self._clock() - start

    def take(self) -> tuple[float, float]:
        """(waited, idle) since the last take, and start again from zero."""
        taken = (self.waited, self.idle)
        self.waited = self.idle = 0.0
        return taken
