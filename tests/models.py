"""Small sharded models and batches shared by the tests (run inside harness ranks).

Three batch shapes: torchrec's DLRM `Batch`, a nested dataclass holding two KJTs, and a plain dict.
`build(kind, sharding)` returns a DistributedModelParallel and its dense optimizer; embeddings use a
fused (in-backward) SGD, as in production. Two builds with the same seed are identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.datasets.utils import Batch
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

DIM = 8
ROWS = 40
DENSE = 4
BATCH = 6
KINDS = ("dlrm", "nested", "dict")
SHARDINGS = ("table_wise", "column_wise")


def tables(prefix: str, n: int) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=f"{prefix}t{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"{prefix}f{i}"]
        )
        for i in range(n)
    ]


@dataclass
class Features:
    user: KeyedJaggedTensor
    item: KeyedJaggedTensor


@dataclass
class NestedBatch:
    dense: torch.Tensor
    features: Features
    labels: torch.Tensor


class TwoTower(nn.Module):
    """Two EBCs fed from a nested dataclass (kind "nested") or a dict (kind "dict")."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.user_ebc = EmbeddingBagCollection(tables=tables("u", 2), device=torch.device("cpu"))
        self.item_ebc = EmbeddingBagCollection(tables=tables("i", 2), device=torch.device("cpu"))
        self.dense = nn.Linear(DENSE, DIM)
        self.over = nn.Linear(5 * DIM, 1)

    def forward(self, batch):
        if self.kind == "nested":
            dense, user, item, labels = batch.dense, batch.features.user, batch.features.item, batch.labels
        else:
            dense, user = batch["dense"], batch["sparse"]["user"]
            item, labels = batch["sparse"]["item"], batch["labels"]
        u = self.user_ebc(user).values()
        i = self.item_ebc(item).values()
        logits = self.over(torch.cat([self.dense(dense), u, i], dim=1)).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, labels)
        return loss, logits.detach()


def unsharded(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "dlrm":
        ebc = EmbeddingBagCollection(tables=tables("", 3), device=torch.device("cpu"))
        return DLRMTrain(
            DLRM(
                embedding_bag_collection=ebc,
                dense_in_features=DENSE,
                dense_arch_layer_sizes=[DIM],
                over_arch_layer_sizes=[8, 1],
            )
        )
    return TwoTower(kind)


def build(kind: str, sharding: str, seed: int = 0) -> tuple[DistributedModelParallel, torch.optim.Optimizer]:
    """The model of `kind`, sharded `sharding` ("table_wise"/"column_wise") over the world group."""
    model = unsharded(kind, seed)
    ebcs = [m for m in model.modules() if isinstance(m, EmbeddingBagCollection)]
    for ebc in ebcs:
        apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.5})
    names = [t.name for ebc in ebcs for t in ebc.embedding_bag_configs()]
    min_partition = DIM // 2 if sharding == "column_wise" else None
    constraints = {
        n: ParameterConstraints(sharding_types=[sharding], min_partition=min_partition) for n in names
    }
    world = dist.get_world_size()
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, compute_device="cpu"), constraints=constraints
    )
    sharders = [EmbeddingBagCollectionSharder()]
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    opt = KeyedOptimizerWrapper(dense, lambda params: torch.optim.SGD(params, lr=0.1))
    return dmp, opt


def _kjt(prefix: str, n: int, gen: torch.Generator) -> KeyedJaggedTensor:
    lengths = torch.randint(0, 4, (n * BATCH,), generator=gen)
    values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=gen)
    return KeyedJaggedTensor.from_lengths_sync(
        keys=[f"{prefix}f{i}" for i in range(n)], values=values, lengths=lengths
    )


def batches(kind: str, n: int, rank: int, seed: int = 1) -> list:
    """`n` distinct batches for `rank`, deterministic in (kind, n, rank, seed)."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    out = []
    for _ in range(n):
        dense = torch.rand(BATCH, DENSE, generator=gen)
        labels = torch.randint(0, 2, (BATCH,), generator=gen).float()
        if kind == "dlrm":
            out.append(Batch(dense_features=dense, sparse_features=_kjt("", 3, gen), labels=labels))
        elif kind == "nested":
            feats = Features(user=_kjt("u", 2, gen), item=_kjt("i", 2, gen))
            out.append(NestedBatch(dense=dense, features=feats, labels=labels))
        else:
            sparse = {"user": _kjt("u", 2, gen), "item": _kjt("i", 2, gen)}
            out.append({"dense": dense, "sparse": sparse, "labels": labels})
    return out


def plain_loop(model: nn.Module, opt: torch.optim.Optimizer, data: list) -> list:
    """The reference: zero_grad, forward, backward, step; the per-step outputs."""
    outputs = []
    for batch in data:
        opt.zero_grad()
        loss, out = model(batch)
        torch.sum(loss).backward()
        opt.step()
        outputs.append(out)
    return outputs


def flat_tensors(obj) -> list[torch.Tensor]:
    """Every tensor in `obj` (outputs, or a state_dict with ShardedTensors), in a fixed order."""
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "local_shards"):
            return [s.tensor for s in obj.local_shards()]
        return [obj]
    if isinstance(obj, dict):
        return [t for k in sorted(obj) for t in flat_tensors(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in flat_tensors(v)]
    return []


def bitwise_equal(a, b) -> bool:
    ta, tb = flat_tensors(a), flat_tensors(b)
    return len(ta) == len(tb) and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y) for x, y in zip(ta, tb, strict=True)
    )
