"""What a rank says about one batch position (`Status`), the errors every rank raises together, and
their messages.

A status is published for every batch a rank fetches (`pipeline.ranks.protocol`): `HAVE`, `EXHAUSTED`
(this rank's dataloader ran dry there), `BAD_KEYS` (the batch's KeyedJaggedTensor keys differ from
the first batch's) or `MALFORMED` (a KeyedJaggedTensor of the batch is not well formed). The
errors here are raised on every rank at the same step, so the process group stays usable after them.
"""

from __future__ import annotations

import enum
import warnings
from typing import Any

__all__ = [
    "AgreedError",
    "BatchKeysError",
    "MalformedBatchError",
    "RidingMismatchError",
    "Status",
    "UnevenDataError",
    "keys_message",
    "malformed_message",
    "uneven_message",
    "warn_untrained",
]


class Status(enum.IntEnum):
    """One rank's status for one batch position (an int, so that a vote can sum it in a tensor)."""

    EXHAUSTED = 0
    """This rank's dataloader has no batch at this position (nor after it)."""
    HAVE = 1
    """This rank has the batch."""
    BAD_KEYS = 2
    """This rank has the batch, but its KeyedJaggedTensor keys differ from the first batch's."""
    MALFORMED = 3
    """This rank has the batch, but one of its KeyedJaggedTensors is malformed (lengths that do not
    sum to the values, a negative length, an id outside its table's rows)."""


class AgreedError(RuntimeError):
    """Raised on every rank at the same step: the process group is still usable."""


class UnevenDataError(AgreedError):
    """`on_uneven="error"`: the ranks' dataloaders hold different numbers of batches."""


class BatchKeysError(AgreedError, ValueError):
    """A batch's KeyedJaggedTensor keys differ from those the model was sharded for."""


class RewriteMismatchError(AgreedError):
    """The ranks found different call sites or programs for the model's sharded modules (a forward
    whose calls depend on the data recorded differently): their input all-to-alls would not match."""


class RidingMismatchError(AgreedError):
    """The row read as a rank's status for a batch is not one: the ranks sent different numbers of
    splits rows (their input all-to-alls do not match), or a row that is not a status word."""


class MalformedBatchError(AgreedError, ValueError):
    """A batch's KeyedJaggedTensor is malformed (`pipeline.ranks.kjt_check`)."""


def keys_message(details: list[Any], expected: list[tuple[str, list[str]]] | None) -> str:
    """The key error's text, from every rank's `(rank, position, found keys or None, ...)`."""
    bad = [d for d in details if d is not None and d[2] is not None]
    parts = [
        f"batch {position} of rank {rank}'s dataloader has keys {_show(found)}"
        for rank, position, found, *_ in bad
    ]
    return (
        f"{'; '.join(parts)}, but the model was sharded for {_show(expected or [])} (the keys of the "
        "first batch). Every rank stopped before that batch. Fix the dataset (a feature renamed, "
        "missing or added), or pass check_keys=False if the keys legitimately vary."
    )


def malformed_message(details: list[Any]) -> str:
    """The malformed-batch error's text, from every rank's `(rank, position, _, problem or None)`."""
    parts = [
        f"batch {position} of rank {rank}'s dataloader: {problem}"
        for rank, position, _, problem in (d for d in details if d is not None)
        if problem is not None
    ]
    return (
        f"{'; '.join(parts)}. Every rank stopped before that batch entered a collective. Fix the "
        "dataset or its collate function, or pass check_kjts=False to skip the check."
    )


def _show(keys: list[tuple[str, list[str]]]) -> str:
    return ", ".join(f"{keys} at {path or 'the batch'}" for path, keys in keys) or "no KeyedJaggedTensor"


def uneven_message(statuses: list[Status], position: int) -> str:
    short = [r for r, s in enumerate(statuses) if s == Status.EXHAUSTED]
    long = [r for r, s in enumerate(statuses) if s != Status.EXHAUSTED]
    return (
        f"uneven data: rank(s) {short} have {position} batches, rank(s) {long} at least "
        f"{position + 1}. Give every rank the same number of batches (drop_last, or pad the shards), "
        'or pass on_uneven="stop" to train the common count.'
    )


def warn_untrained(rank: int, count: int, statuses: list[Status], position: int) -> None:
    short = [r for r, s in enumerate(statuses) if s == Status.EXHAUSTED]
    warnings.warn(
        f"rank {rank}: {count} batch(es) fetched but not trained: rank(s) {short} ran out of data "
        f"after {position} batches, so every rank stopped there. They are in the pipeline's "
        "`untrained_batches`.",
        stacklevel=4,
    )
