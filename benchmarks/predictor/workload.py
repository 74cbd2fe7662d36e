"""What a training step of a model has to do, as facts the cost model needs (`Workload`): the tables
and how they are sharded, the ids a batch brings per feature, the dense layers and parameters.

`workload_of(model, batch)` reads them from a `DistributedModelParallel` (its sharding plan and its
sharded modules' table configs) and one sample batch (every KeyedJaggedTensor in it: ids per sample
per feature, their byte widths, the batch's size in bytes); the dense part comes from an fx trace of
the model with the sharded modules as leaves (the operations of one forward, and the linear layers'
shapes), or, when the model cannot be traced, from its modules. `Workload.at_world_size(w)` places
the same tables on `w` ranks (the rule is in its docstring).
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from rewrite import Tracer, find_kjts, outermost_sharded, unwrap_model

__all__ = ["DenseLayer", "Feature", "Table", "Workload", "workload_of"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Table:
    """One embedding table and where its shards live."""

    name: str
    rows: int
    dim: int
    features: tuple[str, ...]
    sharding: str
    """torchrec's sharding type: `table_wise`, `column_wise`, `row_wise`, `table_row_wise`, ..."""
    kernel: str
    """torchrec's compute kernel (`fused`, `fused_uvm_caching`, ...) or a custom one (`tiered`)."""
    ranks: tuple[int, ...]
    """The rank of each shard."""
    shard_dims: tuple[int, ...]
    """Columns of each shard (all `dim` unless column-wise)."""
    pooled: bool = True
    """Pooled per sample (an EmbeddingBagCollection) or one row per id (an EmbeddingCollection)."""
    module: str = ""
    """FQN of the sharded module that owns it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Feature:
    """One sparse feature of the batch."""

    name: str
    ids_per_sample: float
    """Mean ids (the pooling factor) per sample."""
    weighted: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class DenseLayer:
    """One linear layer outside the sharded modules."""

    fan_in: int
    fan_out: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """One rank's training step, in the facts the cost model reads."""

    world_size: int
    batch_size: int
    """Samples per rank per step."""
    tables: tuple[Table, ...]
    features: tuple[Feature, ...]
    dense_layers: tuple[DenseLayer, ...]
    dense_ops: int
    """Operations of one forward outside the sharded modules (each has a backward too)."""
    dense_params: int
    """Parameters the dense optimizer steps (and DDP all-reduces)."""
    dense_tensors: int
    sharded_modules: int
    id_bytes: int = 8
    length_bytes: int = 4
    batch_bytes: int = 0
    """Bytes of one input batch (every tensor in it)."""
    device: str = "cpu"
    notes: tuple[str, ...] = field(default=())
    """What could not be read and was assumed instead."""

    def feature(self, name: str) -> Feature:
        for f in self.features:
            if f.name == name:
                return f
        return Feature(name=name, ids_per_sample=0.0)

    def at_world_size(self, world_size: int, *, batch_size: int | None = None) -> Workload:
        """The same model on `world_size` ranks (and `batch_size` samples per rank).

        Tables keep their sharding type. Table-wise and column-wise shards are placed again, the
        heaviest (ids times columns) first, each on the rank with the least load so far; row-wise
        tables span every rank, table-row-wise ones the ranks of one host of 8. At more ranks than
        shards some ranks look nothing up, and the busiest rank bounds the step: re-plan the model
        (row-wise or table-row-wise sharding) before trusting a prediction there.
        """
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1; got {world_size}")
        batch = batch_size or self.batch_size
        if world_size == self.world_size:
            return dataclasses.replace(self, batch_size=batch)
        load = [0.0] * world_size
        placed: dict[tuple[str, int], int] = {}
        shards = [
            (t, i)
            for t in self.tables
            if t.sharding in ("table_wise", "column_wise", "data_parallel")
            for i in range(len(t.ranks))
        ]
        shards.sort(key=lambda s: -self._ids(s[0]) * s[0].shard_dims[s[1]])
        for table, i in shards:
            rank = min(range(world_size), key=load.__getitem__)
            placed[table.name, i] = rank
            load[rank] += self._ids(table) * table.shard_dims[i] + 1
        tables = tuple(self._place(t, world_size, placed) for t in self.tables)
        return dataclasses.replace(self, world_size=world_size, batch_size=batch, tables=tables)

    def _ids(self, table: Table) -> float:
        return sum(self.feature(f).ids_per_sample for f in table.features)

    @staticmethod
    def _place(table: Table, world_size: int, placed: dict[tuple[str, int], int]) -> Table:
        if table.sharding == "row_wise":
            return dataclasses.replace(
                table, ranks=tuple(range(world_size)), shard_dims=(table.dim,) * world_size
            )
        if table.sharding == "table_row_wise":
            host = min(world_size, 8)
            return dataclasses.replace(table, ranks=tuple(range(host)), shard_dims=(table.dim,) * host)
        return dataclasses.replace(table, ranks=tuple(placed[table.name, i] for i in range(len(table.ranks))))


def workload_of(model: nn.Module, batch: Any, *, world_size: int | None = None) -> Workload:
    """The `Workload` of `model` (a DistributedModelParallel, or a model holding sharded modules)
    on `batch` (one rank's sample batch, on any device).

    Raises:
        ValueError: the model has no sharded module, or the batch holds no KeyedJaggedTensor for
            its features; the message says which.
    """
    inner = unwrap_model(model)
    sharded = outermost_sharded(inner)
    if not sharded:
        raise ValueError("the model has no sharded module (shard it with DistributedModelParallel first)")
    kjts = [kjt for _, kjt in find_kjts(batch)]
    if not kjts:
        raise ValueError(
            "the sample batch holds no KeyedJaggedTensor; pass a batch as the dataloader yields it"
        )
    world = world_size or (dist.get_world_size() if dist.is_initialized() else 1)
    tables = [t for fqn, m in sharded.items() for t in _tables(fqn, m)]
    features = _features(kjts)
    known = {f.name for f in features}
    notes = [
        f"feature {f} of table {t.name} is not in the batch: no ids assumed"
        for t in tables
        for f in t.features
        if f not in known
    ]
    sharded_params = {id(p) for m in sharded.values() for p in m.parameters()}
    dense = [p for p in inner.parameters() if p.requires_grad and id(p) not in sharded_params]
    layers, ops, note = _dense_structure(inner, sharded)
    values = kjts[0].values()
    return Workload(
        world_size=world,
        batch_size=kjts[0].stride(),
        tables=tuple(tables),
        features=tuple(features),
        dense_layers=tuple(layers),
        dense_ops=ops,
        dense_params=sum(p.numel() for p in dense),
        dense_tensors=len(dense),
        sharded_modules=len(sharded),
        id_bytes=values.element_size(),
        length_bytes=kjts[0].lengths().element_size(),
        batch_bytes=_nbytes(batch),
        device=next((p.device.type for p in inner.parameters()), "cpu"),
        notes=tuple(notes + ([note] if note else [])),
    )


def _tables(fqn: str, module: nn.Module) -> list[Table]:
    plan = getattr(module, "module_sharding_plan", None) or {}
    pooled = "EmbeddingBag" in type(module).__name__
    out = []
    for config in _configs(module):
        sharding = plan.get(config.name)
        ranks = tuple(getattr(sharding, "ranks", None) or (0,))
        dims = (config.embedding_dim,) * len(ranks)
        spec = getattr(sharding, "sharding_spec", None)
        if sharding is not None and sharding.sharding_type == "column_wise" and spec is not None:
            dims = tuple(int(s.shard_sizes[1]) for s in spec.shards)
        out.append(
            Table(
                name=config.name,
                rows=int(config.num_embeddings),
                dim=int(config.embedding_dim),
                features=tuple(config.feature_names),
                sharding=getattr(sharding, "sharding_type", "table_wise"),
                kernel=getattr(sharding, "compute_kernel", "fused"),
                ranks=ranks,
                shard_dims=dims,
                pooled=pooled,
                module=fqn,
            )
        )
    return out


def _configs(module: nn.Module) -> list[Any]:
    # torchrec's sharded modules keep their table configs only under these (private) names
    for attr in ("_embedding_bag_configs", "_embedding_configs"):
        configs = getattr(module, attr, None)
        if isinstance(configs, list) and configs:
            return configs
    for child in module.children():  # a feature-processed collection wraps its collection
        if configs := _configs(child):
            return configs
    return []


def _features(kjts: list[Any]) -> list[Feature]:
    out: dict[str, Feature] = {}
    for kjt in kjts:
        stride = max(kjt.stride(), 1)
        for key, lengths in zip(kjt.keys(), kjt.length_per_key(), strict=True):
            weighted = kjt.weights_or_none() is not None
            out.setdefault(key, Feature(name=key, ids_per_sample=lengths / stride, weighted=weighted))
    return list(out.values())


def _dense_structure(inner: nn.Module, sharded: dict[str, nn.Module]) -> tuple[list[DenseLayer], int, str]:
    """The linear layers outside the sharded modules, and the operations of one forward (from an fx
    trace; without one, the count of leaf modules)."""
    inside = {id(m) for s in sharded.values() for m in s.modules()}
    layers = [
        DenseLayer(fan_in=m.in_features, fan_out=m.out_features)
        for m in inner.modules()
        if isinstance(m, nn.Linear) and id(m) not in inside
    ]
    try:
        graph = Tracer().trace(inner)
    except Exception as e:  # an untraceable forward: fall back to its modules
        leaves = [m for m in inner.modules() if id(m) not in inside and not list(m.children())]
        return (
            layers,
            2 * len(leaves),
            f"fx trace failed ({type(e).__name__}); dense operations counted by module",
        )
    return layers, sum(1 for n in graph.nodes if _dense_op(n, sharded)), ""


def _dense_op(node: fx.Node, sharded: dict[str, nn.Module]) -> bool:
    """An operation on tensors outside the sharded modules (not an attribute or item access)."""
    if node.op == "call_module":
        return node.target not in sharded
    return node.op in ("call_function", "call_method") and node.target not in (getattr, operator.getitem)


def _nbytes(value: Any, seen: set[int] | None = None) -> int:
    """Bytes of every tensor reachable from `value` (dataclasses, namedtuples, dicts, lists, KJTs)."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return 0
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if (
        hasattr(value, "values")
        and hasattr(value, "lengths")
        and hasattr(value, "keys")
        and callable(value.values)
    ):
        parts = [value.values(), value.lengths(), value.weights_or_none()]
        return sum(_nbytes(t, seen) for t in parts if t is not None)
    if isinstance(value, dict):
        return sum(_nbytes(v, seen) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v, seen) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(_nbytes(getattr(value, f.name), seen) for f in dataclasses.fields(value))
    if hasattr(value, "__dict__") and not isinstance(value, (nn.Module, type)):
        return sum(_nbytes(v, seen) for v in vars(value).values())
    return 0
