"""A checkpoint without a drain: the dataloader's state as of the oldest batch not yet trained.

A pipeline fetches batches ahead of the one it trains, so a stateful dataloader's own `state_dict()`
taken between two `progress()` calls is ahead of the model. When the iterator has a `state_dict()`
(torchdata's `StatefulDataLoader`, or any iterator with that method), the pipeline captures it
right before each fetch (`capture`) and keeps it on the batch's context; `resume_state` returns the
one from before the oldest batch still in flight. The pipelines change no parameter or optimizer
state ahead of the step that trains a batch (docs/pipeline.md, "Checkpointing").
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol

__all__ = ["StatefulIterator", "capture", "resume_state"]


class StatefulIterator(Protocol):
    """An iterator whose `state_dict()` says where its next item comes from.

    `state_dict()` must return a snapshot (later `next()` calls must not change it): the pipeline
    keeps one per batch in flight.
    """

    def __next__(self) -> Any: ...

    def state_dict(self) -> Any: ...


def capture(iterator: Iterator[Any]) -> Any:
    """The state of `iterator` before its next item is fetched; None if it keeps no state."""
    state_dict = getattr(iterator, "state_dict", None)
    return state_dict() if state_dict is not None else None


def resume_state(iterator: Iterator[Any], inflight: Iterable[Any]) -> Any:
    """The state to restore `iterator` to so that it yields the oldest untrained batch next.

    Args:
        iterator: the dataloader iterator given to `progress()`.
        inflight: the contexts of its batches in flight, oldest first (each with `loader_state`).

    Raises:
        TypeError: `iterator` has no `state_dict()`: call `pipe.drain(iterator)` before saving
            instead, then save the iterator's position by your own means.
    """
    if getattr(iterator, "state_dict", None) is None:
        raise TypeError(
            f"{type(iterator).__name__} has no state_dict(), so the pipeline cannot say where its "
            "oldest untrained batch came from: use a stateful dataloader (torchdata's "
            "StatefulDataLoader) or call pipe.drain(iterator) on every rank before saving"
        )
    for ctx in inflight:
        return ctx.loader_state  # the oldest: fetched after every batch that has been trained
    return iterator.state_dict()
