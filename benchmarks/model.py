"""Build the sharded DLRM of a `BenchConfig`, and the batches every variant trains on.

`build_model` seeds the global RNG first, so two calls on the same config give bit-identical models
(weights, sharding plan, optimizer state): each variant of a round starts from the same model.
`make_batches` draws each batch from its own generator seeded by (seed, rank, index), so all variants
see the same batches, generated in memory before any timing starts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.datasets.utils import Batch
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig
from torchrec.distributed.types import CacheParams
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from benchmarks.configs import NUM_DENSE, BenchConfig
from examples.dlrm.model import unsharded_dlrm

__all__ = ["BuiltModel", "batch_nbytes", "build_model", "make_batches", "table_configs"]

# gloo has no row-wise sharding; on CUDA the planner may choose freely.
_CPU_SHARDING = ["table_wise", "column_wise"]
_LR = 0.05


@dataclass(kw_only=True, slots=True)
class BuiltModel:
    """A sharded model and the optimizer the training loop steps."""

    model: nn.Module
    """DistributedModelParallel over DLRMTrain; `model(batch)` returns `(loss, output)`."""
    optimizer: torch.optim.Optimizer
    """Steps the dense parameters; the embeddings use SGD fused into backward."""


def table_configs(config: BenchConfig) -> list[EmbeddingBagConfig]:
    """The config's tables: `t<i>` looked up by feature `f<i>`, all of one shape."""
    return [
        EmbeddingBagConfig(
            name=f"t{i}",
            embedding_dim=config.embedding_dim,
            num_embeddings=config.num_embeddings,
            feature_names=[f"f{i}"],
        )
        for i in range(config.num_tables)
    ]


def build_model(
    config: BenchConfig, *, device: torch.device, seed: int = 0, store_dir: str | None = None
) -> BuiltModel:
    """Build and shard `config`'s DLRM over the default process group (a collective call).

    A config with `cache_fraction` puts its tables on the `tiered` kernel, table-wise round-robin
    over the ranks (torchrec's planner refuses that kernel), with stores created afresh in
    `store_dir` from the seeded initial weights, so every variant starts from the same tables. On
    CUDA it puts them on torchrec's UVM-caching kernel instead (rows in host memory, that fraction
    cached in HBM, filled by `prefetch()`): the GPU's counterpart of the disk and its RAM cache.
    """
    torch.manual_seed(seed)
    tables = table_configs(config)
    dlrm = unsharded_dlrm(
        tables,
        embedding_dim=config.embedding_dim,
        dense_hidden=config.dense_hidden,
        over_hidden=config.over_hidden,
    )
    ebc = dlrm.model.sparse_arch.embedding_bag_collection
    apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": _LR})
    world_size = dist.get_world_size()
    if config.cache_fraction is not None and device.type == "cpu":
        if store_dir is None:
            raise ValueError(f"{config.name} keeps its tables on disk: give store_dir")
        return _on_disk(dlrm, tables, config, store_dir=store_dir, device=device)
    sharding = _CPU_SHARDING if device.type == "cpu" else None
    kernels, cache = None, None
    if config.cache_fraction is not None:
        kernels = [EmbeddingComputeKernel.FUSED_UVM_CACHING.value]
        cache = CacheParams(load_factor=config.cache_fraction, prefetch_pipeline=True)
    constraints = {
        t.name: ParameterConstraints(sharding_types=sharding, compute_kernels=kernels, cache_params=cache)
        for t in tables
    }
    planner = EmbeddingShardingPlanner(
        topology=TopologyFactory.create_topology(
            trainer_config=TrainerConfig(world_size=world_size, local_world_size=world_size),
            kernel_config=KernelConfig(compute_device=device.type),
        ),
        batch_size=config.batch_size,
        constraints=constraints,
        storage_reservation=FixedPercentageStorageReservation(0.15),
    )
    sharders = [EmbeddingBagCollectionSharder()]
    plan = planner.collective_plan(dlrm, sharders, dist.GroupMember.WORLD)
    model = DistributedModelParallel(dlrm, device=device, plan=plan, sharders=sharders)
    dense = dict(in_backward_optimizer_filter(model.named_parameters()))
    optimizer = KeyedOptimizerWrapper(dense, lambda params: torch.optim.SGD(params, lr=_LR))
    return BuiltModel(model=model, optimizer=optimizer)


def _on_disk(
    dlrm: nn.Module, tables: list[EmbeddingBagConfig], config: BenchConfig, *, store_dir: str, device
) -> BuiltModel:
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan

    from tiered import TIERED, TieredEmbeddingBagCollectionSharder, TieredOptions

    options = TieredOptions(store_dir=store_dir, cache_fraction=config.cache_fraction, cold=True)
    sharder = TieredEmbeddingBagCollectionSharder(options)
    world_size = dist.get_world_size()
    per_table = {t.name: table_wise(rank=i % world_size, compute_kernel=TIERED) for i, t in enumerate(tables)}
    ebc = dlrm.model.sparse_arch.embedding_bag_collection
    module_plan = construct_module_sharding_plan(
        ebc, per_param_sharding=per_table, sharder=sharder, world_size=world_size, device_type="cpu"
    )
    plan = ShardingPlan({"model.sparse_arch.embedding_bag_collection": module_plan})
    model = DistributedModelParallel(dlrm, device=device, plan=plan, sharders=[sharder])
    dense = dict(in_backward_optimizer_filter(model.named_parameters()))
    optimizer = KeyedOptimizerWrapper(dense, lambda params: torch.optim.SGD(params, lr=_LR))
    return BuiltModel(model=model, optimizer=optimizer)


def make_batches(config: BenchConfig, *, count: int, rank: int, seed: int = 0) -> list[Batch]:
    """`count` batches of `config.batch_size` samples for `rank`, on CPU, deterministic in the
    arguments: ids uniform or power-law (`config.id_skew`), lengths uniform around
    `config.ids_per_feature`, random labels."""
    out = []
    for index in range(count):
        gen = torch.Generator().manual_seed((seed * 1_000_003 + rank) * 1_000_003 + index)
        n, p = config.batch_size, config.ids_per_feature
        lengths = torch.randint(1, 2 * p, (config.num_tables * n,), generator=gen, dtype=torch.int32)
        values = _ids(config, int(lengths.sum()), gen)
        sparse = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{i}" for i in range(config.num_tables)], values=values, lengths=lengths
        )
        dense = torch.rand(n, NUM_DENSE, generator=gen)
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
    ranks = ranks.long().clamp_(0, rows - 1)
    return ranks * 2_654_435_761 % rows


def batch_nbytes(batch: Batch) -> int:
    """Bytes of every tensor one batch holds (dense, labels, ids, lengths, offsets)."""
    kjt = batch.sparse_features
    tensors = [batch.dense_features, batch.labels, kjt.values(), kjt.lengths(), kjt.offsets()]
    return sum(t.numel() * t.element_size() for t in tensors)
