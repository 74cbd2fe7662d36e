"""`DataLoadingThread`: a thread that loads the next batch and copies it to the device while the
caller trains on the current one (torchrec 1.8's class of the same name, signature and behaviour).

One batch at most is held ahead: the thread fetches the next only once the caller has taken the
last, so a dataloader is never read further than one batch past what the caller has seen. The end
of the dataloader, `stop()`, and an error end it; an error whose `is_retryable` (or its cause's) is
true skips that batch instead, with a warning.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any, Generic

import torch

from pipeline.compat.types import In
from pipeline.stages.copy import to_device
from pipeline.stages.streams import label

__all__ = ["DataLoadingThread"]

logger = logging.getLogger(__name__)


class DataLoadingThread(threading.Thread, Generic[In]):
    """Loads batches from `dataloader_iter` one ahead of `get_next_batch()`, on a daemon thread.

    Args:
        device: where each batch is copied (on CUDA, on `memcpy_stream`).
        dataloader_iter: the batches.
        to_device_non_blocking: the copy's `non_blocking`.
        memcpy_stream_priority: the priority of the stream made when `memcpy_stream` is None (CUDA).
        memcpy_stream: the stream the copies run on; None: a new one on CUDA, none elsewhere.

    Call `start()`, then `get_next_batch()` from one thread (the training loop); `stop()` ends it.
    """

    def __init__(
        self,
        device: torch.device,
        dataloader_iter: Iterator[In],
        to_device_non_blocking: bool,
        memcpy_stream_priority: int = 0,
        memcpy_stream: torch.Stream | None = None,
    ) -> None:
        super().__init__(name="DataLoadingThread", daemon=True)  # never keeps Python from exiting
        if memcpy_stream is None and device.type == "cuda":
            memcpy_stream = torch.cuda.Stream(device, priority=memcpy_stream_priority)
        self._device = device
        self._iterator = dataloader_iter
        self._non_blocking = to_device_non_blocking
        self._stream = memcpy_stream
        self._changed = threading.Condition()
        self._loaded: list[Any] = []
        """The batch loaded ahead (at most one)."""
        self._ended = False
        """No batch will be loaded: the dataloader ended or failed, or `stop()` was called."""
        self._error: Exception | None = None
        """The dataloader's error, raised once by `get_next_batch()`."""

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
                if loaded is None or self._ended:
                    self._ended = True
                else:
                    self._loaded.append(loaded[0])
                self._changed.notify_all()

    def stop(self) -> None:
        """End the thread after the batch it is loading (that batch is dropped) and wake a waiting
        `get_next_batch()`; a batch already loaded can still be taken."""
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def get_next_batch(self, none_throws: bool = False) -> In | None:
        """The next batch, on the device; waits for it to be loaded.

        Returns:
            The batch, or None once the dataloader ended (or the thread stopped).

        Raises:
            StopIteration: instead of returning None, with `none_throws=True`.
            Exception: the dataloader's own error (once; None after it).
        """
        with self._changed:
            self._changed.wait_for(lambda: self._loaded or self._ended)
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            if self._loaded:
                batch = self._loaded.pop()
                self._changed.notify_all()
                return batch
        if none_throws:
            raise StopIteration
        return None

    def _load(self) -> tuple[Any] | None:
        """The next batch, copied, in a 1-tuple; None at the end or on an error (kept for the
        caller)."""
        while True:
            try:
                with label("pipeline::data_loading::fetch"):
                    batch = next(self._iterator)
            except StopIteration:
                return None
            except Exception as e:
                if _retryable(e):
                    logger.warning("DataLoadingThread: skipping a batch after a retryable error: %r", e)
                    continue
                self._error = e
                return None
            copy_on = contextlib.nullcontext() if self._stream is None else torch.cuda.stream(self._stream)
            with label("pipeline::data_loading::copy"), copy_on:
                return (to_device(batch, self._device, non_blocking=self._non_blocking),)


def _retryable(error: BaseException) -> bool:
    """torchrec's rule: the error, or the error it was raised from, says `is_retryable`."""
    for e in (error, error.__cause__):
        if hasattr(e, "is_retryable"):
            return bool(e.is_retryable)
    return False
