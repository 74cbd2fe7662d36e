"""The bound a step is measured against: compute alone and communication alone, per config.

`capture` runs, once per config, each batch's real input_dist on a freshly built model and keeps
what every sharded EmbeddingBagCollection received (context and ids) and the shapes of its lookups
and of its output. Then:

- `compute_alone`: the same local work with input_dist and output_dist taken out: the dense MLPs,
  the embedding lookups on the ids this rank really receives, the interaction, the loss, backward
  (the fused embedding update included) and the optimizer step. The model is called below
  DistributedModelParallel and DDP, so no collective runs: each sharded module's forward is
  replaced by its lookups on the captured ids, their outputs laid out (a copy, padded or cut where
  the two ranks' shards differ in width) as the pooled embeddings output_dist would deliver.
- `comm_alone`: every collective of a training step, back to back, with no compute between them:
  the real input_dist (splits and values all-to-alls, KJT assembly), the pooled-embedding
  all-to-all forward and backward on zero tensors of the captured shapes, and DDP's gradient
  all-reduce in its bucket sizes (1 MiB first, then 25 MiB).

A pipeline cannot beat max(compute alone, communication alone); its step over that max is its
distance to the bound. Both step functions raise StopIteration when the captured batches run out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedTensor

__all__ = ["Captured", "capture", "comm_alone", "compute_alone", "inner_model"]

_FIRST_BUCKET = 2**20  # DDP's first gradient bucket
_BUCKET = 25 * 2**20


@dataclass(kw_only=True, slots=True)
class _Received:
    """What one sharded module received for one batch."""

    ctx: Any
    dist_input: Any
    lookup_shapes: list[torch.Size]
    out_shape: torch.Size


@dataclass(kw_only=True, slots=True)
class Captured:
    """Per batch, per sharded module (by FQN), what it received; and the dense gradient size."""

    batches: list[dict[str, _Received]] = field(default_factory=list)
    dense_numel: int = 0


def inner_model(model: nn.Module) -> nn.Module:
    """The model below DistributedModelParallel and DDP."""
    inner = getattr(model, "_dmp_wrapped_module", model)
    return inner.module if isinstance(inner, DistributedDataParallel) else inner


def _sharded(model: nn.Module) -> dict[str, ShardedEmbeddingBagCollection]:
    modules = inner_model(model).named_modules()
    return {n: m for n, m in modules if isinstance(m, ShardedEmbeddingBagCollection)}


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
                )
            out.batches.append(received)
    return out


def compute_alone(
    model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, captured: Captured
) -> Callable[[Iterator[Any]], Any]:
    """A step function: one training step of `model` without any collective (module docstring)."""
    inner = inner_model(model)
    modules = _sharded(model)
    position = [0]
    for name, ebc in modules.items():
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
        lookups = ebc.compute(received.ctx, received.dist_input)
        flat = torch.cat([t.reshape(-1) for t in lookups])
        need = received.out_shape.numel()
        if flat.numel() >= need:
            flat = flat[:need]
        else:
            flat = torch.cat([flat, flat.new_zeros(need - flat.numel())])
        return KeyedTensor(
            keys=ebc._embedding_names,
            length_per_key=ebc._embedding_dims,
            values=flat.view(received.out_shape),
        )

    return forward


def comm_alone(model: nn.Module, device: torch.device, captured: Captured) -> Callable[[Iterator[Any]], Any]:
    """A step function: every collective of one training step, with no compute (module docstring)."""
    modules = _sharded(model)
    sizes, left = [], captured.dense_numel
    while left > 0:
        size = min(left, (_FIRST_BUCKET if not sizes else _BUCKET) // 4)
        sizes.append(size)
        left -= size
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
            shapes = received[name].lookup_shapes
            lookups = [torch.zeros(s, device=device, requires_grad=True) for s in shapes]
            pooled = ebc.output_dist(ctx, lookups).wait().values()
            pooled.backward(torch.ones_like(pooled))
        works = [dist.all_reduce(g, async_op=True) for g in grads]
        for work in works:
            work.wait()
        position[0] += 1
        return None

    return step
