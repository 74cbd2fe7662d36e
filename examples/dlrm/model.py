"""Build DLRM, shard it with DistributedModelParallel, and make its optimizers.

Embedding tables use the fused kernel: their row-wise Adagrad runs inside the backward pass
(`apply_optimizer_in_backward`), so they never hold a `.grad`. The dense MLPs are data-parallel
(DDP) and stepped by a plain Adagrad wrapped as a keyed optimizer, which is what the pipelines step.
On CPU the planner may only shard table-wise or column-wise: torchrec has no row-wise sharding
over gloo.

torchrec's planner breaks ties between equally good sharding types in the order of a Python `set`,
which changes with the interpreter's string-hash seed: the same flags gave `column_wise` on one run
and `table_wise` on the next. `_OrderedEnumerator` hands the planner each table's options in the
order of `--sharding-types` instead, so the same flags on the same world size give the same plan,
and `plan` (printed in the summary) names it with a digest that two runs can compare.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.planner.types import (
    KernelConfig,
    PlannerError,
    ShardingOption,
    TopologyFactory,
    TrainerConfig,
)
from torchrec.distributed.types import ModuleSharder, ShardingEnv, ShardingPlan
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from examples.dlrm.config import NUM_DENSE, InputError, TrainConfig
from examples.dlrm.features import SPARSE_NAMES
from examples.dlrm.store import store_errors, tiered_plan

__all__ = ["ShardedDLRM", "build_model"]

# Gloo can run the all-to-alls of these two only; the fused kernel rules out data_parallel.
_CPU_SHARDING = ("table_wise", "column_wise")
_GPU_SHARDING = ("table_wise", "column_wise", "row_wise", "table_row_wise", "table_column_wise")


@dataclass(kw_only=True, slots=True)
class ShardedDLRM:
    """The sharded model and what trains it."""

    model: nn.Module
    """DistributedModelParallel over DLRMTrain: `model(batch)` returns `(loss, (loss, logits,
    labels))`."""
    optimizer: torch.optim.Optimizer
    """Steps the dense parameters; the embeddings step themselves during backward."""
    plan: str
    """One line saying how the tables were sharded, with a digest of the whole plan (table, sharding
    type, kernel, ranks): two runs with the same digest sharded alike."""


def build_model(
    config: TrainConfig, *, device: torch.device, world_size: int, local_world_size: int
) -> ShardedDLRM:
    """Build, shard and place DLRM on `device`; needs the default process group.

    The global RNG is seeded with `config.seed` first, so every rank and every run starts from the
    same weights.
    """
    torch.manual_seed(config.seed)
    tables = [
        EmbeddingBagConfig(
            name=f"t_{feature}",
            embedding_dim=config.embedding_dim,
            num_embeddings=size,
            feature_names=[feature],
        )
        for feature, size in zip(SPARSE_NAMES, config.table_sizes, strict=True)
    ]
    dlrm = unsharded_dlrm(
        tables,
        embedding_dim=config.embedding_dim,
        dense_hidden=config.dense_hidden,
        over_hidden=config.over_hidden,
    )
    ebc = dlrm.model.sparse_arch.embedding_bag_collection
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": config.lr})

    model, plan = _shard(
        dlrm, config, device=device, world_size=world_size, local_world_size=local_world_size
    )
    dense = dict(in_backward_optimizer_filter(model.named_parameters()))
    optimizer = KeyedOptimizerWrapper(dense, lambda ps: torch.optim.Adagrad(ps, lr=config.lr))
    return ShardedDLRM(model=model, optimizer=optimizer, plan=_describe(plan))


def unsharded_dlrm(
    tables: list[EmbeddingBagConfig],
    *,
    embedding_dim: int,
    dense_hidden: tuple[int, ...],
    over_hidden: tuple[int, ...],
) -> DLRMTrain:
    """DLRMTrain over `tables` and NUM_DENSE dense features, its embeddings on the meta device.

    Nothing is allocated for the tables: sharding materializes each rank's own shards.
    """
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    return DLRMTrain(
        DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=NUM_DENSE,
            dense_arch_layer_sizes=[*dense_hidden, embedding_dim],
            over_arch_layer_sizes=[*over_hidden, 1],
        )
    )


def _shard(
    dlrm: DLRMTrain,
    config: TrainConfig,
    *,
    device: torch.device,
    world_size: int,
    local_world_size: int,
) -> tuple[DistributedModelParallel, ShardingPlan]:
    sharding = _sharding_types(config.sharding_types, device)
    pg = dist.group.WORLD
    if config.embedding_store is not None:
        return _shard_on_disk(dlrm, config, device=device, world_size=world_size, sharding=sharding)
    constraints = {
        f"t_{feature}": ParameterConstraints(sharding_types=list(sharding), compute_kernels=["fused"])
        for feature in SPARSE_NAMES
    }
    topology = TopologyFactory.create_topology(
        trainer_config=TrainerConfig(world_size=world_size, local_world_size=local_world_size),
        kernel_config=KernelConfig(compute_device=device.type),
    )
    batch_size = config.local_batch_size(world_size)
    enumerator = _OrderedEnumerator(
        sharding, topology=topology, batch_size=batch_size, constraints=constraints
    )
    planner = EmbeddingShardingPlanner(
        topology=topology,
        batch_size=batch_size,
        enumerator=enumerator,
        constraints=constraints,
        storage_reservation=FixedPercentageStorageReservation(0.15),
        debug=False,
    )
    sharders = [EmbeddingBagCollectionSharder()]
    try:
        plan = planner.collective_plan(dlrm, sharders, pg)
    except PlannerError as e:
        message = f"the sharding planner found no plan for these tables: {e}"
        raise InputError(message, every_rank=True) from e
    model = DistributedModelParallel(
        dlrm, env=ShardingEnv.from_process_group(pg), device=device, plan=plan, sharders=sharders
    )
    return model, plan


def _shard_on_disk(
    dlrm: DLRMTrain,
    config: TrainConfig,
    *,
    device: torch.device,
    world_size: int,
    sharding: tuple[str, ...],
) -> tuple[DistributedModelParallel, ShardingPlan]:
    """Every table on the tiered kernel, with a hand-built plan (see `examples.dlrm.store`)."""
    if device.type != "cpu":
        raise InputError("--embedding-store runs on CPU only; add --device cpu", every_rank=True)
    ebc = dlrm.model.sparse_arch.embedding_bag_collection
    fqn = "model.sparse_arch.embedding_bag_collection"
    plan, sharder = tiered_plan(ebc, fqn, config, world_size=world_size, sharding=sharding)
    pg = dist.group.WORLD
    try:
        model = DistributedModelParallel(
            dlrm, env=ShardingEnv.from_process_group(pg), device=device, plan=plan, sharders=[sharder]
        )
    except store_errors() as e:
        message = str(e).replace("store_mode='create'", "--store-mode create")
        raise InputError(f"--embedding-store: {message}") from e
    return model, plan


def _sharding_types(requested: tuple[str, ...] | None, device: torch.device) -> tuple[str, ...]:
    allowed = _CPU_SHARDING if device.type == "cpu" else _GPU_SHARDING
    unknown = sorted(set(requested or ()) - set(allowed))
    if unknown:
        raise InputError(
            f"--sharding-types {','.join(unknown)} cannot be used on {device.type}; "
            f"choose from {','.join(allowed)}",
            every_rank=True,
        )
    return requested or allowed


class _OrderedEnumerator(EmbeddingEnumerator):
    """torchrec's enumerator, with each table's options in the order of `preferred` sharding types
    (torchrec's own order depends on the string-hash seed; see the module docstring)."""

    def __init__(self, preferred: tuple[str, ...], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._preferred = preferred

    def enumerate(self, module: nn.Module, sharders: list[ModuleSharder]) -> list[ShardingOption]:
        options = super().enumerate(module, sharders)
        first_seen: dict[str, int] = {}
        for option in options:
            first_seen.setdefault(option.fqn, len(first_seen))
        rank = {name: i for i, name in enumerate(self._preferred)}

        def key(item: tuple[int, ShardingOption]) -> tuple:
            index, option = item
            kind = rank.get(option.sharding_type, len(rank))
            return (first_seen[option.fqn], kind, option.compute_kernel, index)

        return [option for _, option in sorted(enumerate(options), key=key)]


def _describe(plan: ShardingPlan) -> str:
    kinds: Counter[str] = Counter()
    per_rank: Counter[int] = Counter()
    entries = []
    for module_fqn, module_plan in sorted(plan.plan.items()):
        for table, sharding in sorted(module_plan.items()):  # type: ignore[attr-defined]
            kinds[f"{sharding.sharding_type}/{sharding.compute_kernel}"] += 1
            ranks = sharding.ranks or []
            per_rank.update(ranks)
            entries.append(f"{module_fqn}.{table}:{sharding.sharding_type}:{sharding.compute_kernel}:{ranks}")
    digest = hashlib.sha1("\n".join(entries).encode()).hexdigest()[:10]
    shards = ", ".join(f"{n} on rank {r}" for r, n in sorted(per_rank.items()))
    counts = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
    return f"{counts} tables (shards: {shards}; plan {digest})"
