"""`state_digest`: one hash of every parameter and optimizer state of the whole sharded model.

Each rank hashes what it holds (its shards of the embedding tables and their optimizer state, keyed
by name and shard offsets; the replicated dense parameters and their optimizer state on rank 0
only), the ranks gather the hashes, and the digest is one hash of them all in a fixed order. Two
runs that trained the same batches from the same start on the same sharding have the same digest,
whatever their pipeline, and whether or not they were interrupted and resumed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from examples.dlrm.checkpoint import model_state, tiered_kernels

__all__ = ["state_digest"]


def state_digest(model: nn.Module, optimizer: torch.optim.Optimizer, *, tiered: bool) -> str:
    """The digest (32 hex digits) of `model`, its fused optimizer and the dense `optimizer`; a
    collective. With `tiered`, the tables on disk are hashed from their store files, streamed."""
    rank = dist.get_rank()
    mine = sorted(_hashes(model_state(model, optimizer, tiered=tiered), rank))
    if tiered:
        from tiered.snapshot import digest_stores

        mine += [(f"store/{name}", (), digest) for name, digest in digest_stores(tiered_kernels(model))]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    total = hashlib.blake2b(digest_size=16)
    for item in sorted(i for per_rank in gathered for i in per_rank):
        total.update(repr(item).encode())
    return total.hexdigest()


def _hashes(state: Any, rank: int, prefix: str = "") -> Iterator[tuple[str, tuple[int, ...], str]]:
    if isinstance(state, dict):
        for key, value in state.items():
            yield from _hashes(value, rank, f"{prefix}{key}.")
    elif hasattr(state, "local_shards"):  # a ShardedTensor: this rank's shards only
        for shard in state.local_shards():
            yield prefix, tuple(shard.metadata.shard_offsets), _tensor_hash(shard.tensor)
    elif isinstance(state, torch.Tensor) and rank == 0:  # replicated: one copy is enough
        yield prefix, (), _tensor_hash(state)


def _tensor_hash(tensor: torch.Tensor) -> str:
    data = tensor.detach().cpu().contiguous()
    raw = data.reshape(-1).view(torch.uint8).numpy()
    return f"{data.dtype}{tuple(data.shape)}:{hashlib.blake2b(raw, digest_size=16).hexdigest()}"
