"""Issue 22's tiny sharded model and its endless feed of batches (`benchmarks.overhead`'s workload).

4 tables of 1,000 rows x 8 (table-wise), batch 64, one linear layer over the pooled embeddings and 4
dense features; SGD fused into backward for the tables, SGD for the linear layer. `Feed` yields fresh
`Batch` objects over a pool of 64 distinct batches per rank, the same for every loop compared.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["Feed", "Tiny", "build"]

_TABLES, _ROWS, _DIM, _BATCH, _DENSE = 4, 1000, 8, 64, 4
_POOL = 64  # distinct batches per variant, cycled (new objects every step)


def build(seed: int = 0) -> tuple[Any, Any]:
    import torch
    import torch.distributed as dist
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    torch.manual_seed(seed)
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=_DIM, num_embeddings=_ROWS, feature_names=[f"f{i}"])
        for i in range(_TABLES)
    ]
    model = Tiny(EmbeddingBagCollection(tables=tables, device=torch.device("meta")))
    apply_optimizer_in_backward(torch.optim.SGD, model.ebc.parameters(), {"lr": 0.05})
    world = dist.get_world_size()
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, compute_device="cpu"),
        constraints={t.name: ParameterConstraints(sharding_types=["table_wise"]) for t in tables},
    )
    sharders = [EmbeddingBagCollectionSharder()]
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    return dmp, KeyedOptimizerWrapper(dense, lambda params: torch.optim.SGD(params, lr=0.05))


class Tiny(nn.Module):
    """EBC -> concat with the dense features -> one linear layer -> BCE loss."""

    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.ebc = ebc
        self.linear = nn.Linear(_TABLES * _DIM + _DENSE, 1)

    def forward(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = self.ebc(batch.sparse_features).values()
        logits = self.linear(torch.cat([pooled, batch.dense_features], dim=1)).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels.float())
        return loss, logits.detach()


def _batches(rank: int) -> list[Any]:
    import torch
    from torchrec import KeyedJaggedTensor
    from torchrec.datasets.utils import Batch

    out = []
    for i in range(_POOL):
        gen = torch.Generator().manual_seed(rank * 100_003 + i)
        lengths = torch.randint(1, 6, (_TABLES * _BATCH,), generator=gen, dtype=torch.int32)
        values = torch.randint(0, _ROWS, (int(lengths.sum()),), generator=gen)
        out.append(
            (values, lengths, torch.rand(_BATCH, _DENSE, generator=gen), torch.randint(0, 2, (_BATCH,)))
        )
    keys = [f"f{i}" for i in range(_TABLES)]

    def make(parts: tuple) -> Any:
        values, lengths, dense, labels = parts
        kjt = KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)
        return Batch(dense_features=dense, sparse_features=kjt, labels=labels)

    return [make, out]


class Feed:
    """An endless iterator of fresh Batch objects over a pool of tensors (the same on every variant)."""

    def __init__(self, rank: int) -> None:
        self._make, self._pool = _batches(rank)
        self._i = 0

    def __iter__(self) -> Feed:
        return self

    def __next__(self) -> Any:
        parts = self._pool[self._i % len(self._pool)]
        self._i += 1
        return self._make(parts)
