"""The bound a step is measured against: its halves run alone, on the same batches.

`capture` runs, once per config, each batch's real input_dist on a freshly built model and keeps what
every sharded EmbeddingBagCollection received (context and ids) and the shapes of its lookups and of
its output. Then three step functions, each raising StopIteration when the captured batches run out:

- `compute_alone`: the same local work with input_dist and output_dist taken out: the dense part, the
  lookups on the ids this rank really receives, the loss, backward (the fused embedding update
  included) and the optimizer step. The model runs below DistributedModelParallel and DDP, so no
  collective runs: each sharded module's forward is replaced, on this benchmark's own model, by its
  lookups on the captured ids, laid out (padded or cut where the ranks' shards differ in width) as
  output_dist would deliver them. With tables on disk the model caches every row (`warm`).
- `comm_alone`: every collective of a step back to back, no compute between them: the real input_dist,
  the pooled-embedding all-to-all forward and backward on zero tensors of the captured shapes, and
  DDP's gradient all-reduce in its bucket sizes (1 MiB first, then 25 MiB).
- `io_alone`: tables on disk, the prefetch of the same batches with no forward or backward: each
  batch's rows made resident, marked updated and released, so evictions write back as in training.

A pipeline that overlaps the halves cannot beat the larger: its step over that max is its distance to
the bound.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.model_parallel import get_unwrapped_module
from torchrec.sparse.jagged_tensor import KeyedTensor

from tiered import TieredShardedEmbeddingBagCollection

__all__ = ["Captured", "capture", "comm_alone", "compute_alone", "io_alone", "warm"]

_FIRST_BUCKET, _BUCKET = 2**20, 25 * 2**20  # DDP's gradient buckets
_WARM_CHUNK = 65_536  # rows read into a cache at a time while warming


@dataclass(kw_only=True, slots=True)
class _Received:
    """What one sharded module received for one batch, and the shape of what it returned."""

    ctx: Any
    dist_input: Any
    lookup_shapes: list[torch.Size]
    out_shape: torch.Size
    keys: list[str]
    length_per_key: list[int]


@dataclass(kw_only=True, slots=True)
class Captured:
    """Per batch, per sharded module (by name), what it received; and the dense gradient size."""

    batches: list[dict[str, _Received]] = field(default_factory=list)
    dense_numel: int = 0


def _sharded(model: nn.Module, kind: type = ShardedEmbeddingBagCollection) -> dict[str, Any]:
    """The sharded modules of `kind` below DistributedModelParallel and DDP, by name."""
    return {n: m for n, m in get_unwrapped_module(model).named_modules() if isinstance(m, kind)}


def capture(model: nn.Module, optimizer: Any, batches: list[Any], device: torch.device) -> Captured:
    """Run each batch's input_dist, lookups and output_dist on `model` (a collective call)."""
    out = Captured(dense_numel=sum(p.numel() for g in optimizer.param_groups for p in g["params"]))
    with torch.no_grad():
        for batch in batches:
            batch = batch.to(device)
            received = {}
            for name, ebc in _sharded(model).items():
                ctx = ebc.create_context()
                dist_input = ebc.input_dist(ctx, batch.sparse_features).wait().wait()
                lookups = ebc.compute(ctx, dist_input)
                pooled = ebc.output_dist(ctx, lookups).wait()
                received[name] = _Received(
                    ctx=ctx,
                    dist_input=dist_input,
                    lookup_shapes=[t.shape for t in lookups],
                    out_shape=pooled.values().shape,
                    keys=pooled.keys(),
                    length_per_key=pooled.length_per_key(),
                )
            out.batches.append(received)
    return out


def compute_alone(
    model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, captured: Captured
) -> Callable[[Iterator[Any]], Any]:
    """A step function: one training step of `model` without any collective (module docstring)."""
    inner = get_unwrapped_module(model)
    position = [0]
    for name, ebc in _sharded(model).items():
        ebc.forward = _replay(ebc, name, captured, position)  # type: ignore[method-assign]

    def step(batches: Iterator[Any]) -> Any:
        if position[0] >= len(captured.batches):
            raise StopIteration
        batch = next(batches).to(device)
        optimizer.zero_grad()
        loss, output = inner(batch)
        torch.sum(loss).backward()
        optimizer.step()
        position[0] += 1
        return output

    return step


def _replay(ebc: ShardedEmbeddingBagCollection, name: str, captured: Captured, position: list[int]):
    def forward(*args: Any, **kwargs: Any) -> KeyedTensor:
        received = captured.batches[position[0]][name]
        flat = torch.cat([t.reshape(-1) for t in ebc.compute(received.ctx, received.dist_input)])
        need = received.out_shape.numel()
        flat = flat[:need] if flat.numel() >= need else torch.cat([flat, flat.new_zeros(need - flat.numel())])
        return KeyedTensor(
            keys=received.keys, length_per_key=received.length_per_key, values=flat.view(received.out_shape)
        )

    return forward


def comm_alone(model: nn.Module, device: torch.device, captured: Captured) -> Callable[[Iterator[Any]], Any]:
    """A step function: every collective of one training step, with no compute (module docstring)."""
    modules = _sharded(model)
    sizes, left = [], captured.dense_numel
    while left > 0:
        sizes.append(min(left, (_FIRST_BUCKET if not sizes else _BUCKET) // 4))
        left -= sizes[-1]
    grads = [torch.zeros(n, device=device) for n in sizes]
    position = [0]

    def step(batches: Iterator[Any]) -> Any:
        if position[0] >= len(captured.batches):
            raise StopIteration
        batch = next(batches).to(device)
        received = captured.batches[position[0]]
        for name, ebc in modules.items():
            ctx = ebc.create_context()
            ebc.input_dist(ctx, batch.sparse_features).wait().wait()
            lookups = [
                torch.zeros(s, device=device, requires_grad=True) for s in received[name].lookup_shapes
            ]
            pooled = ebc.output_dist(ctx, lookups).wait().values()
            pooled.backward(torch.ones_like(pooled))
        for work in [dist.all_reduce(g, async_op=True) for g in grads]:
            work.wait()
        position[0] += 1

    return step


def warm(model: nn.Module) -> None:
    """Read every row of every table on disk of `model` into its cache (which must hold them all)."""
    for ebc in _sharded(model, TieredShardedEmbeddingBagCollection).values():
        for cache in (c for kernel in ebc.tiered_kernels() for c in kernel.caches):
            if cache.capacity < cache.store.rows:
                raise ValueError(f"{cache.name}: {cache.capacity} slots for {cache.store.rows} rows")
            for start in range(0, cache.store.rows, _WARM_CHUNK):
                cache.acquire(torch.arange(start, min(start + _WARM_CHUNK, cache.store.rows))).release()


def io_alone(model: nn.Module, captured: Captured) -> Callable[[Iterator[Any]], Any]:
    """A step function: the prefetch of the next captured batch alone (module docstring)."""
    modules = _sharded(model, TieredShardedEmbeddingBagCollection)
    if not modules:
        raise ValueError("io-alone needs tables on disk: run it on a config with cache_fraction")
    position = [0]

    def step(batches: Iterator[Any]) -> Any:
        if position[0] >= len(captured.batches):
            raise StopIteration
        next(batches)
        with torch.no_grad():
            for name, ebc in modules.items():
                dist_input = captured.batches[position[0]][name].dist_input
                ebc.prefetch(dist_input=dist_input)
                ebc.release_prefetched(dist_input, updated=True)
        position[0] += 1

    return step
