"""Models written the way recommendation code is usually written, for the pipelines' rewrite: the
batch's KeyedJaggedTensor split between collections inside forward, key selection, a KJT built from
plain tensors with constant keys, one collection called on two KJTs, and a forward the fx trace
cannot follow (so the first batch is recorded). Run inside harness ranks.

Every pattern trains: the pooled embeddings and the dense features go through a linear layer into
a binary cross-entropy loss; `model(batch)` returns `(loss, logits)`. Tables alternate table-wise and
column-wise sharding (mixed in one model), with a fused in-backward SGD; `build` returns the
DistributedModelParallel and its dense optimizer, identical for the same seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, JaggedTensor, KeyedJaggedTensor
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from tests.models import BATCH, DENSE, DIM, MAX_BAG, ROWS, mark_stashed, tables

PATTERNS = ("split", "select", "to_dict", "built", "jt_dict", "shared", "recorded")
"""The patterns, and how many call sites each pipelines (one per call of a sharded module)."""
SITES = {"split": 2, "select": 2, "to_dict": 2, "built": 2, "jt_dict": 2, "shared": 3, "recorded": 3}
KEYS = ["sf0", "sf1", "sf2"]


@dataclass
class UserBatch:
    """What a dataloader of such models yields: one KJT of every sparse feature, a second KJT of
    history features, plain tensors of ids and lengths, dense features and labels."""

    sparse: KeyedJaggedTensor
    history: KeyedJaggedTensor
    ids: torch.Tensor
    lengths: torch.Tensor
    dense: torch.Tensor
    labels: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> UserBatch:
        return UserBatch(*(getattr(self, f).to(device=device, non_blocking=non_blocking) for f in _FIELDS))


_FIELDS = ("sparse", "history", "ids", "lengths", "dense", "labels")


class UserModel(nn.Module):
    """One model, seven forwards: `pattern` picks how the sharded collections get their KJTs."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = pattern
        cpu = torch.device("cpu")
        self.a = EmbeddingBagCollection(tables=tables("s", 2), device=cpu)  # sf0, sf1
        # sf2 and the history feature hf0, where the pattern looks them up
        if pattern in ("split", "select", "to_dict"):
            self.b = EmbeddingBagCollection(tables=tables("s", 3)[2:], device=cpu)
        else:
            self.h = EmbeddingBagCollection(tables=tables("h", 1), device=cpu)
        pooled = 4 if pattern in ("shared", "recorded") else 3  # tables looked up, per sample
        self.head = nn.Linear(DENSE + DIM * pooled, 1)

    def forward(self, batch: UserBatch) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = [p.values() for p in self._embeddings(batch)]
        logits = self.head(torch.cat([batch.dense, *pooled], dim=1)).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, logits.detach()

    def _embeddings(self, batch: UserBatch) -> list:
        p = self.pattern
        if p == "split":
            first, second = batch.sparse.split([2, 1])
            return [self.a(first), self.b(second)]
        if p == "select":  # keys picked by name, in another order than the batch's
            picked = KeyedJaggedTensor.from_jt_dict({k: batch.sparse[k] for k in ("sf1", "sf0")})
            return [self.a(picked), self.b(KeyedJaggedTensor.from_jt_dict({"sf2": batch.sparse["sf2"]}))]
        if p == "to_dict":
            by_key = batch.sparse.to_dict()
            a = KeyedJaggedTensor.from_jt_dict({"sf0": by_key["sf0"], "sf1": by_key["sf1"]})
            return [self.a(a), self.b(KeyedJaggedTensor.from_jt_dict({"sf2": by_key["sf2"]}))]
        built = KeyedJaggedTensor.from_lengths_sync(keys=["hf0"], values=batch.ids, lengths=batch.lengths)
        if p == "built":
            return [self.a(batch.sparse.permute([0, 1])), self.h(built)]
        if p == "jt_dict":
            jt = JaggedTensor(values=batch.ids, lengths=batch.lengths)
            return [
                self.a(batch.sparse.split([2, 1])[0]),
                self.h(KeyedJaggedTensor.from_jt_dict({"hf0": jt})),
            ]
        if p == "recorded" and bool(batch.labels.sum() >= 0):  # data-dependent: no fx trace
            built = KeyedJaggedTensor(keys=["hf0"], values=batch.ids, lengths=batch.lengths)
        # shared (and recorded): one collection called on the history and on the built KJT
        first, _ = batch.sparse.split([2, 1])
        return [self.a(first), self.h(batch.history), self.h(built)]


def build(
    pattern: str, seed: int = 0, *, stash: tuple[str, ...] = ()
) -> tuple[DistributedModelParallel, torch.optim.Optimizer]:
    """The model of `pattern`, its tables sharded table-wise and column-wise by turns (the tables
    named in `stash` marked `stash_weights=True`)."""
    torch.manual_seed(seed)
    model = UserModel(pattern)
    ebcs = [m for m in model.children() if isinstance(m, EmbeddingBagCollection)]
    mark_stashed(ebcs, stash)
    for ebc in ebcs:
        apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.5})
    names = [t.name for ebc in ebcs for t in ebc.embedding_bag_configs()]
    constraints = {
        name: ParameterConstraints(sharding_types=["column_wise"], min_partition=DIM // 2)
        if i % 2
        else ParameterConstraints(sharding_types=["table_wise"])
        for i, name in enumerate(names)
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=dist.get_world_size(), compute_device="cpu"), constraints=constraints
    )
    sharder = EmbeddingBagCollectionSharder()
    plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    return dmp, KeyedOptimizerWrapper(dense, lambda params: torch.optim.SGD(params, lr=0.1))


def batches(n: int, rank: int, seed: int = 3, *, bag: int | None = None) -> list[UserBatch]:
    """`n` distinct batches for `rank`, deterministic in (n, rank, seed); with `bag`, every bag has
    that many ids, so that every batch has the same shapes (distinct ids and dense values)."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)

    def bags(keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = torch.randint(0, MAX_BAG + 1, (keys * BATCH,), generator=gen)
        if bag is not None:
            lengths = torch.full_like(lengths, bag)
        return torch.randint(0, ROWS, (int(lengths.sum()),), generator=gen), lengths

    out = []
    for _ in range(n):
        (s_ids, s_len), (h_ids, h_len), (ids, lengths) = bags(3), bags(1), bags(1)
        out.append(
            UserBatch(
                sparse=KeyedJaggedTensor.from_lengths_sync(keys=KEYS, values=s_ids, lengths=s_len),
                history=KeyedJaggedTensor.from_lengths_sync(keys=["hf0"], values=h_ids, lengths=h_len),
                ids=ids,
                lengths=lengths,
                dense=torch.rand(BATCH, DENSE, generator=gen),
                labels=torch.randint(0, 2, (BATCH,), generator=gen).float(),
            )
        )
    return out
