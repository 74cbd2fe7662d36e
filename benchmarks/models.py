"""Build the sharded model of a `BenchConfig`, and the batches every variant trains on.

`build_model` seeds the global RNG first, so two calls on the same config give bit-identical models
(weights, sharding plan, optimizer state): each variant of a round starts from the same model.
`make_batches` draws each batch from its own generator seeded by (seed, rank, index), so every
variant sees the same batches, made in memory before any timing starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.datasets.utils import Batch
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from torchrec.distributed.types import CacheParams, ShardingPlan
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from benchmarks.configs import BenchConfig
from examples.dlrm.model import unsharded_dlrm
from tiered import TIERED, TieredEmbeddingBagCollectionSharder, TieredOptions

__all__ = [
    "BuiltModel",
    "Linear",
    "LinearBuilt",
    "LinearShared",
    "LinearSplit",
    "batch_nbytes",
    "build_model",
    "make_batches",
    "memory_fraction",
]

_LR = 0.05


@dataclass(kw_only=True, slots=True)
class BuiltModel:
    """A sharded model and the optimizer the training loop steps."""

    model: nn.Module
    """DistributedModelParallel; `model(batch)` returns `(loss, output)`."""
    optimizer: torch.optim.Optimizer
    """Steps the dense parameters; the embeddings use SGD fused into backward."""


class Linear(nn.Module):
    """The `linear` head: pooled embeddings and dense features -> one linear layer -> BCE loss."""

    def __init__(self, ebc: EmbeddingBagCollection, config: BenchConfig) -> None:
        super().__init__()
        self.ebc = ebc
        self.linear = nn.Linear(config.num_tables * config.embedding_dim + config.num_dense, 1)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        return self.head(self.ebc(batch.sparse_features).values(), batch)

    def head(self, pooled: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.linear(torch.cat([pooled, batch.dense_features], dim=1)).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels.float())
        return loss, logits.detach()


class LinearSplit(Linear):
    """`linear-split`: the batch's KJT split in forward between two collections of half the tables."""

    def __init__(self, tables: list[EmbeddingBagConfig], config: BenchConfig) -> None:
        half = len(tables) // 2
        super().__init__(EmbeddingBagCollection(tables=tables[:half], device=torch.device("meta")), config)
        self.second = EmbeddingBagCollection(tables=tables[half:], device=torch.device("meta"))
        self.segments = [half, len(tables) - half]

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        first, second = batch.sparse_features.split(self.segments)
        return self.head(torch.cat([self.ebc(first).values(), self.second(second).values()], dim=1), batch)


class LinearBuilt(Linear):
    """`linear-built`: forward builds the collection's KJT from the batch's values and lengths."""

    def __init__(self, tables: list[EmbeddingBagConfig], config: BenchConfig) -> None:
        super().__init__(EmbeddingBagCollection(tables=tables, device=torch.device("meta")), config)
        self.keys = [f for t in tables for f in t.feature_names]

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        kjt = batch.sparse_features
        built = KeyedJaggedTensor(keys=self.keys, values=kjt.values(), lengths=kjt.lengths())
        return self.head(self.ebc(built).values(), batch)


class LinearShared(Linear):
    """`linear-shared`: one collection of the first half of the tables, called on the first half of
    the features and again on the second half (renamed to the first half's keys)."""

    def __init__(self, tables: list[EmbeddingBagConfig], config: BenchConfig) -> None:
        half = len(tables) // 2
        super().__init__(EmbeddingBagCollection(tables=tables[:half], device=torch.device("meta")), config)
        self.keys = [f for t in tables[:half] for f in t.feature_names]
        self.segments = [half, len(tables) - half]

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        first, second = batch.sparse_features.split(self.segments)
        renamed = KeyedJaggedTensor(keys=self.keys, values=second.values(), lengths=second.lengths())
        return self.head(torch.cat([self.ebc(first).values(), self.ebc(renamed).values()], dim=1), batch)


_PATTERNS = {"linear-split": LinearSplit, "linear-built": LinearBuilt, "linear-shared": LinearShared}


def build_model(
    config: BenchConfig, *, device: torch.device, seed: int = 0, store_dir: str = ""
) -> BuiltModel:
    """Build and shard `config`'s model over the default process group (a collective call).

    Tables on disk (`cache_fraction`, on CPU) go on the `tiered` kernel, table-wise round-robin over
    the ranks (torchrec's planner does not know that kernel), with cold stores created afresh in
    `store_dir`. On CUDA the same configs use torchrec's UVM-caching kernel, filled by `prefetch()`,
    and the process may allocate the config's `gpu_memory_gib` of the GPU (all of it if None: set at
    every build, as one process may build configs with and without a cap).
    """
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(memory_fraction(config, total), device)
    torch.manual_seed(seed)
    dim, rows = config.embedding_dim, config.num_embeddings
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows, feature_names=[f"f{i}"])
        for i in range(config.num_tables)
    ]
    fqn = "model.sparse_arch.embedding_bag_collection" if config.head == "dlrm" else "ebc"
    if config.head == "dlrm":
        hidden = {"dense_hidden": config.dense_hidden, "over_hidden": config.over_hidden}
        model = unsharded_dlrm(tables, embedding_dim=dim, **hidden)
    elif config.head == "linear":
        model = Linear(EmbeddingBagCollection(tables=tables, device=torch.device("meta")), config)
    else:
        model = _PATTERNS[config.head](tables, config)
    ebc = model.get_submodule(fqn)
    collections = [m for m in model.modules() if isinstance(m, EmbeddingBagCollection)]
    embeddings = [p for c in collections for p in c.parameters()]
    apply_optimizer_in_backward(torch.optim.SGD, embeddings, {"lr": _LR})
    if config.cache_fraction is not None and device.type == "cpu":
        if len(collections) > 1:
            raise ValueError(f"{config.name}: tables on disk take one collection, {config.head} has more")
        if not store_dir:
            raise ValueError(f"{config.name} keeps its tables on disk: give a store directory")
        sharder: Any = TieredEmbeddingBagCollectionSharder(
            TieredOptions(store_dir=store_dir, cache_fraction=config.cache_fraction, cold=True)
        )
        world = dist.get_world_size()
        per_table = {t.name: table_wise(rank=i % world, compute_kernel=TIERED) for i, t in enumerate(tables)}
        module_plan = construct_module_sharding_plan(
            ebc, per_param_sharding=per_table, sharder=sharder, world_size=world, device_type="cpu"
        )
        plan = ShardingPlan({fqn: module_plan})
    else:
        sharder = EmbeddingBagCollectionSharder()
        plan = _plan(model, config, device, sharder)
    dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=[sharder])
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    optimizer = KeyedOptimizerWrapper(dense, lambda params: torch.optim.SGD(params, lr=_LR))
    return BuiltModel(model=dmp, optimizer=optimizer)


def memory_fraction(config: BenchConfig, total_bytes: int) -> float:
    """The share of a GPU of `total_bytes` that `config`'s process may allocate: `gpu_memory_gib` of
    it, or all of it (None, or a cap at least the GPU's size)."""
    if config.gpu_memory_gib is None:
        return 1.0
    return min(1.0, config.gpu_memory_gib * 2**30 / total_bytes)


def _plan(model: nn.Module, config: BenchConfig, device: torch.device, sharder: Any) -> ShardingPlan:
    kernels, cache = None, None
    if config.cache_fraction is not None:  # CUDA: rows in host memory, a fraction cached in HBM
        kernels = [EmbeddingComputeKernel.FUSED_UVM_CACHING.value]
        cache = CacheParams(load_factor=config.cache_fraction, prefetch_pipeline=True)
    sharding = list(config.sharding_types) if device.type == "cpu" else None
    constraints = {
        f"t{i}": ParameterConstraints(sharding_types=sharding, compute_kernels=kernels, cache_params=cache)
        for i in range(config.num_tables)
    }
    world = dist.get_world_size()
    planner = EmbeddingShardingPlanner(
        topology=TopologyFactory.create_topology(
            trainer_config=TrainerConfig(world_size=world, local_world_size=world),
            kernel_config=KernelConfig(compute_device=device.type),
        ),
        batch_size=config.batch_size,
        constraints=constraints,
        storage_reservation=FixedPercentageStorageReservation(0.15),
    )
    return planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)


def make_batches(config: BenchConfig, *, count: int, rank: int, seed: int = 0) -> list[Batch]:
    """`count` batches of `config.batch_size` samples for `rank`, on CPU, deterministic in the
    arguments: ids uniform or power-law, lengths uniform around `ids_per_feature`, random labels."""
    out = []
    for index in range(count):
        gen = torch.Generator().manual_seed((seed * 1_000_003 + rank) * 1_000_003 + index)
        n, p = config.batch_size, config.ids_per_feature
        lengths = torch.randint(1, 2 * p, (config.num_tables * n,), generator=gen, dtype=torch.int32)
        values = _ids(config, int(lengths.sum()), gen)
        if config.id_dtype == "int32":  # the same ids and lengths, as a 32-bit dataloader makes them
            values = values.int()
        sparse = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{i}" for i in range(config.num_tables)], values=values, lengths=lengths
        )
        dense = torch.rand(n, config.num_dense, generator=gen)
        labels = torch.randint(0, 2, (n,), generator=gen)
        out.append(Batch(dense_features=dense, sparse_features=sparse, labels=labels))
    return out


def _ids(config: BenchConfig, count: int, gen: torch.Generator) -> torch.Tensor:
    rows = config.num_embeddings
    if config.id_skew is None:
        return torch.randint(0, rows, (count,), generator=gen)
    # inverse CDF of the continuous power law on [1, rows + 1), then popularity rank -> row by a
    # multiplicative hash (odd and not a multiple of 5: a bijection for the usual row counts)
    u, a = torch.rand(count, generator=gen, dtype=torch.float64), config.id_skew
    if abs(a - 1.0) < 1e-9:
        ranks = torch.pow(float(rows + 1), u) - 1
    else:
        ranks = torch.pow((float(rows + 1) ** (1 - a) - 1) * u + 1, 1 / (1 - a)) - 1
    return ranks.long().clamp_(0, rows - 1) * 2_654_435_761 % rows


def batch_nbytes(batch: Batch) -> int:
    """Bytes of every tensor one batch holds (dense, labels, ids, lengths, offsets)."""
    kjt = batch.sparse_features
    tensors = [batch.dense_features, batch.labels, kjt.values(), kjt.lengths(), kjt.offsets()]
    return sum(t.numel() * t.element_size() for t in tensors)
