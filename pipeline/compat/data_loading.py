"""`DataLoadingThread`: torchrec's thread (same name, signature and behaviour) that loads and copies
the next batch to the device, one batch ahead of the caller; a batch whose error (or its cause) says
`is_retryable` is skipped, any other error ends the loading and `get_next_batch()` raises it."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any, Generic

import torch

from pipeline.compat import In
from pipeline.pipelines.core import to_device
from pipeline.stages.streams import label

__all__ = ["DataLoadingThread"]

logger = logging.getLogger(__name__)


class DataLoadingThread(threading.Thread, Generic[In]):
    """A daemon thread: `start()` it, call `get_next_batch()` from one thread, `stop()` it.

    Args:
        device: where each batch is copied.
        dataloader_iter: the batches.
        to_device_non_blocking: the copy's `non_blocking`.
        memcpy_stream_priority: the priority of the stream made when `memcpy_stream` is None (CUDA).
        memcpy_stream: the copies' stream; None: a new one on CUDA, none elsewhere.
    """

    def __init__(
        self,
        device: torch.device,
        dataloader_iter: Iterator[In],
        to_device_non_blocking: bool,
        memcpy_stream_priority: int = 0,
        memcpy_stream: torch.Stream | None = None,
    ) -> None:
        super().__init__(name="DataLoadingThread", daemon=True)
        if memcpy_stream is None and device.type == "cuda":
            memcpy_stream = torch.cuda.Stream(device, priority=memcpy_stream_priority)
        self._device = device
        self._iterator = dataloader_iter
        self._non_blocking = to_device_non_blocking
        self._stream = memcpy_stream
        self._changed = threading.Condition()
        self._loaded: list[Any] = []  # at most one batch
        self._ended = False  # no batch will be loaded (end, error or `stop()`)
        self._error: Exception | None = None  # raised once by `get_next_batch()`

    def run(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)  # the caller's device, not device 0
        while True:
            with self._changed:
                self._changed.wait_for(lambda: not self._loaded or self._ended)
                if self._ended:
                    return
            loaded = self._load()
            with self._changed:
                self._ended |= loaded is None
                if not self._ended:
                    self._loaded.append(loaded[0])
                self._changed.notify_all()

    def stop(self) -> None:
        """End the thread, dropping the batch it is loading; a batch already loaded can be taken."""
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def get_next_batch(self, none_throws: bool = False) -> In | None:
        """The next batch, on the device, once it is loaded; None once the loading ended.

        Raises:
            StopIteration: instead of returning None, with `none_throws=True`.
            Exception: the dataloader's own error (once).
        """
        with self._changed:
            self._changed.wait_for(lambda: self._loaded or self._ended)
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            if self._loaded:
                self._changed.notify_all()  # wakes the loader once this returns
                return self._loaded.pop()
        if none_throws:
            raise StopIteration
        return None

    def _load(self) -> tuple[Any] | None:
        """The next batch, copied, in a 1-tuple; None at the end or on an error (kept in `_error`)."""
        while True:
            try:
                with label("pipeline::data_loading::fetch"):
                    batch = next(self._iterator)
            except StopIteration:
                return None
            except Exception as e:
                marked = [c for c in (e, e.__cause__) if hasattr(c, "is_retryable")]
                if marked and marked[0].is_retryable:
                    logger.warning("DataLoadingThread: skipping a batch after a retryable error: %r", e)
                    continue
                self._error = e
                return None
            copy_on = contextlib.nullcontext() if self._stream is None else torch.cuda.stream(self._stream)
            with label("pipeline::data_loading::copy"), copy_on:
                return (to_device(batch, self._device, non_blocking=self._non_blocking),)
