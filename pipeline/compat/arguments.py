"""Checks of torchrec's constructor arguments that mean something else here, or nothing."""

from __future__ import annotations

from torch import nn
from torchrec.distributed.model_parallel import DMPCollection

__all__ = ["refuse_jit", "sync_interval"]


def refuse_jit(apply_jit: bool) -> None:
    """torchrec's `apply_jit` (TorchScript the pipelined modules) is not supported here.

    Raises:
        ValueError: `apply_jit` is True.
    """
    if apply_jit:
        raise ValueError("apply_jit=True is not supported (no TorchScript); leave it False")


def sync_interval(model: nn.Module, interval: int | None) -> int | None:
    """The replicas' sync interval for `model` (`dmp_collection_sync_interval_batches`): None
    unless it is a DMPCollection.

    Raises:
        ValueError: not None or a positive int; or other than torchrec's default (1) or None on
            any other model.
    """
    if interval is not None and (not isinstance(interval, int) or interval < 1):
        raise ValueError(
            f"dmp_collection_sync_interval_batches must be None or a positive int; got {interval!r}"
        )
    if isinstance(model, DMPCollection):
        return interval
    if interval not in (None, 1):
        raise ValueError(
            f"dmp_collection_sync_interval_batches={interval!r} syncs the replicas of a DMPCollection "
            f"(2D sharding), but the model is a {type(model).__name__}; leave it at 1 or None"
        )
    return None
