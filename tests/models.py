"""Small sharded models and batches shared by the tests (run inside harness ranks).

Four kinds (KINDS): torchrec's DLRM on its `Batch`, a two-tower model on a nested dataclass holding
two KJTs or on a plain dict, and a feature-processed EBC (position-weighted features) on torchrec's
`Batch`. A fifth, "postproc", feeds the two towers through postprocs called with collections; a
sixth, "weighted", is the DLRM on a weighted EBC, its batches' KJTs carrying a weight per id.
`build(kind, sharding)` returns a DistributedModelParallel and its dense optimizer; embeddings use a
fused (in-backward) SGD, as in production; the position weights are dense (data-parallel) parameters.
Two builds with the same seed are identical. Table- and column-wise plans come from torchrec's planner;
row-wise is planned by hand, since the planner refuses it on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.datasets.utils import Batch
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DataParallelWrapper
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from torchrec.distributed.types import CacheParams, ShardingPlan
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

DIM = 8
ROWS = 40
DENSE = 4
BATCH = 6
MAX_BAG = 3  # bags hold 0 to MAX_BAG ids
KINDS = ("dlrm", "nested", "dict", "fp")
SHARDINGS = ("table_wise", "column_wise", "row_wise")


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
    """Two EBCs fed from a nested dataclass (kind "nested"), a dict (kind "dict"), or a nested
    dataclass through postprocs called with collections (kind "postproc", see `WithPostprocs`)."""

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
        return self.head(dense, user, item, labels)

    def head(self, dense, user, item, labels):
        u = self.user_ebc(user).values()
        i = self.item_ebc(item).values()
        logits = self.over(torch.cat([self.dense(dense), u, i], dim=1)).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, labels)
        return loss, logits.detach()


class ShiftIds(nn.Module):
    """Parameter-free postproc called with a list and a dict: the ids of `parts[0]` shifted by
    `opts["by"]` times the integer part of `parts[1].sum()` (a dense tensor of the batch)."""

    def forward(self, parts: list, opts: dict) -> KeyedJaggedTensor:
        features, dense = parts
        values = features.values().clone()
        values += dense.sum().long() * opts["by"]
        return KeyedJaggedTensor.from_lengths_sync(
            keys=features.keys(), values=values % ROWS, lengths=features.lengths()
        )


class Pick(nn.Module):
    """Parameter-free postproc called with a dict holding a tuple: `spec["kjts"][spec["index"]]`."""

    def forward(self, spec: dict) -> KeyedJaggedTensor:
        return spec["kjts"][spec["index"]]


class WithPostprocs(TwoTower):
    """TwoTower on the nested batch, each EBC fed by a postproc whose arguments are collections of
    batch values and constants (the pattern of torchrec's TestModelWithPreprocCollectionArgs)."""

    def __init__(self) -> None:
        super().__init__("nested")
        self.shift = ShiftIds()
        self.pick = Pick()

    def forward(self, batch):
        user = self.shift([batch.features.user, batch.dense], {"by": 1})
        item = self.pick({"kjts": (batch.features.item, batch.features.user), "index": 0})
        return self.head(batch.dense, user, item, batch.labels)


class PositionWeighted(nn.Module):
    """A FeatureProcessedEmbeddingBagCollection (trainable per-position weights) on torchrec's Batch."""

    def __init__(self) -> None:
        super().__init__()
        configs = tables("", 3)
        ebc = EmbeddingBagCollection(tables=configs, is_weighted=True, device=torch.device("cpu"))
        weights = PositionWeightedModuleCollection({f"f{i}": MAX_BAG for i in range(len(configs))})
        self.fp_ebc = FeatureProcessedEmbeddingBagCollection(ebc, weights)
        self.dense = nn.Linear(DENSE, DIM)
        self.over = nn.Linear(4 * DIM, 1)

    def forward(self, batch: Batch):
        pooled = self.fp_ebc(batch.sparse_features).values()
        logits = self.over(torch.cat([self.dense(batch.dense_features), pooled], dim=1)).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, logits.detach()


def unsharded(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "fp":
        return PositionWeighted()
    if kind == "postproc":
        return WithPostprocs()
    if kind in ("dlrm", "weighted"):
        weighted = kind == "weighted"
        ebc = EmbeddingBagCollection(tables=tables("", 3), is_weighted=weighted, device=torch.device("cpu"))
        return DLRMTrain(
            DLRM(
                embedding_bag_collection=ebc,
                dense_in_features=DENSE,
                dense_arch_layer_sizes=[DIM],
                over_arch_layer_sizes=[8, 1],
            )
        )
    return TwoTower(kind)


def build(
    kind: str,
    sharding: str,
    seed: int = 0,
    *,
    device: torch.device | None = None,
    cache: CacheParams | None = None,
    ddp: bool = True,
    stash: tuple[str, ...] = (),
) -> tuple[DistributedModelParallel, torch.optim.Optimizer]:
    """The model of `kind`, sharded `sharding` (one of SHARDINGS) over the world group, on `device`
    (the CPU by default). With `cache`, the tables use torchrec's UVM-caching kernel (CUDA only).
    Without `ddp`, the dense part is not wrapped in DDP (each rank trains its own copy of it).
    The tables named in `stash` are marked `stash_weights=True`."""
    device = device or torch.device("cpu")
    model = unsharded(kind, seed)
    ebcs = [m for m in model.modules() if isinstance(m, EmbeddingBagCollection)]
    mark_stashed(ebcs, stash)
    for ebc in ebcs:
        apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.5})
    sharders = [FeatureProcessedEmbeddingBagCollectionSharder(), EmbeddingBagCollectionSharder()]
    if sharding == "row_wise":
        plan = _row_wise_plan(model, device.type)
    else:
        names = [t.name for ebc in ebcs for t in ebc.embedding_bag_configs()]
        min_partition = DIM // 2 if sharding == "column_wise" else None
        kernels = None if cache is None else [EmbeddingComputeKernel.FUSED_UVM_CACHING.value]
        constraints = {
            n: ParameterConstraints(
                sharding_types=[sharding],
                min_partition=min_partition,
                compute_kernels=kernels,
                cache_params=cache,
            )
            for n in names
        }
        planner = EmbeddingShardingPlanner(
            topology=Topology(world_size=dist.get_world_size(), compute_device=device.type),
            constraints=constraints,
        )
        plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    wrapper = None if ddp else _NoDataParallel()
    dmp = DistributedModelParallel(
        model, device=device, plan=plan, sharders=sharders, data_parallel_wrapper=wrapper
    )
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    opt = KeyedOptimizerWrapper(dense, lambda params: torch.optim.SGD(params, lr=0.1))
    return dmp, opt


def mark_stashed(ebcs: list[EmbeddingBagCollection], names: tuple[str, ...]) -> None:
    """Mark the tables `names` of `ebcs` `stash_weights=True` (before sharding)."""
    for ebc in ebcs:
        for config in ebc.embedding_bag_configs():
            config.stash_weights = config.name in names


class _NoDataParallel(DataParallelWrapper):
    """Leaves the dense part of a DistributedModelParallel unwrapped (no DDP, no gradient sync)."""

    def wrap(self, dmp: DistributedModelParallel, env, device: torch.device) -> None:
        pass


def _row_wise_plan(model: nn.Module, device_type: str) -> ShardingPlan:
    """Every table row-wise over the world, for each outermost (FP-)EBC of `model`."""
    world = dist.get_world_size()
    plan = {}
    for fqn, module in model.named_modules():  # parents come before their children
        if any(fqn.startswith(f"{planned}.") for planned in plan):
            continue  # the EBC inside an FP-EBC is sharded with it
        if isinstance(module, FeatureProcessedEmbeddingBagCollection):
            configs = module._embedding_bag_collection.embedding_bag_configs()
        elif isinstance(module, EmbeddingBagCollection):
            configs = module.embedding_bag_configs()
        else:
            continue
        per_table = {t.name: row_wise() for t in configs}
        plan[fqn] = construct_module_sharding_plan(
            module, per_table, local_size=world, world_size=world, device_type=device_type
        )
    return ShardingPlan(plan)


def _kjt(prefix: str, n: int, gen: torch.Generator, *, weighted: bool = False) -> KeyedJaggedTensor:
    lengths = torch.randint(0, MAX_BAG + 1, (n * BATCH,), generator=gen)
    values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=gen)
    weights = torch.rand(values.numel(), generator=gen) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(
        keys=[f"{prefix}f{i}" for i in range(n)], values=values, lengths=lengths, weights=weights
    )


def batches(kind: str, n: int, rank: int, seed: int = 1) -> list:
    """`n` distinct batches for `rank`, deterministic in (kind, n, rank, seed)."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    out = []
    for _ in range(n):
        dense = torch.rand(BATCH, DENSE, generator=gen)
        labels = torch.randint(0, 2, (BATCH,), generator=gen).float()
        if kind in ("dlrm", "fp", "weighted"):
            sparse = _kjt("", 3, gen, weighted=kind == "weighted")
            out.append(Batch(dense_features=dense, sparse_features=sparse, labels=labels))
        elif kind in ("nested", "postproc"):
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


_REFERENCES: dict[tuple, tuple[list, list]] = {}


def reference(kind: str, sharding: str, steps: int, rank: int, seed: int = 1) -> tuple[list, list]:
    """The plain loop on `build(kind, sharding)` and `batches(kind, steps, rank, seed)`: its per-step
    outputs and its final state (the tensors of `flat_tensors(state_dict)`), both for
    `bitwise_equal`. Computed once per rank process and (world size, arguments), then kept: a pool's
    ranks check every pipeline of a module against one reference. Both ranks of a pool run the same
    scenarios, so both build (a collective) or both reuse; a restarted pool starts empty. Read-only."""
    key = (dist.get_world_size(), kind, sharding, steps, rank, seed)
    if key not in _REFERENCES:
        model, opt = build(kind, sharding)
        outputs = plain_loop(model, opt, batches(kind, steps, rank, seed))
        state = flat_tensors(model.state_dict())
        _REFERENCES[key] = (
            [o.detach().clone() for o in flat_tensors(outputs)],
            [t.detach().clone() for t in state],
        )
    return _REFERENCES[key]


def stale_lookup_loop(model: nn.Module, opt: torch.optim.Optimizer, data: list) -> list:
    """The reference of a semi-synchronous lookup (SparseDataDistUtil's lookup stage): the plain
    loop, except that batch i+1's embeddings are looked up before batch i's update.

    Step i: the tables as they are now (after batch i-1's update) are what batch i+1 will read;
    batch i reads the ones saved at step i-1 (for i = 0, the current ones). The embeddings are
    updated in backward (fused SGD), which does not read the weights, so the gradients of the stale
    lookup go to the current tables. Dense parameters are current. The tables are swapped through
    the state_dict: a kernel whose state_dict tensors are its weights (not a UVM cache's store).
    """
    tables = embedding_tables(model)
    saved: list | None = None  # the tables before the previous batch's update
    outputs = []
    for batch in data:
        now = [t.clone() for t in tables]
        if saved is not None:  # through .data: autograd must not see the swap as a change
            for t, old in zip(tables, saved, strict=True):
                t.data.copy_(old)
        opt.zero_grad()
        loss, out = model(batch)
        if saved is not None:
            for t, cur in zip(tables, now, strict=True):
                t.data.copy_(cur)
        saved = now
        torch.sum(loss).backward()
        opt.step()
        outputs.append(out)
    return outputs


def embedding_tables(model: nn.Module) -> list[torch.Tensor]:
    """This rank's shards of every embedding table of `model`, sharing the kernels' storage."""
    state = model.state_dict()
    return flat_tensors({k: v for k, v in state.items() if ".embedding_bags." in k})


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


def run_to_end(pipe, it, limit: int = 1000, *, schedules: list | None = None) -> list:
    """`pipe.progress(it)` until StopIteration; the outputs. Fails after `limit` outputs (a pipeline
    that never stops). With `schedules`, appends `pipe.input_dist_schedule` after each step."""
    outputs = []
    while True:
        try:
            outputs.append(pipe.progress(it))
        except StopIteration:
            return outputs
        if schedules is not None:
            schedules.append(pipe.input_dist_schedule)
        assert len(outputs) <= limit, f"no StopIteration after {limit} outputs"


def recorded_run(
    make_pipe, batches, *, broken: bool | str = False, lag: int = 1, watched: int | None = None
) -> tuple[dict, object]:
    """Run a pipeline to the end on `RecordingStreams`, each step inside its `watch()`, then
    `wait_all()`, and check its hand-offs.

    `make_pipe(streams)` builds the pipeline. `broken`: False, True (the hand-off forgets to wait),
    or one of `RecordingStreams.BROKEN`: the checker must then fail. `lag`: batches after which a
    fake event completes. `watched`: how many steps run inside `watch()` (None: all; dynamo does
    not compile under it, so a compiled step runs outside). Returns `summarize()`'s result and the
    streams.
    """
    import contextlib

    from tests import streamcheck

    streams = streamcheck.RecordingStreams(lag=lag, broken="no-wait" if broken is True else (broken or None))
    pipe, it = make_pipe(streams), iter(batches)
    outputs = []
    while True:
        try:
            with streams.watch() if watched is None or len(outputs) < watched else contextlib.nullcontext():
                outputs.append(pipe.progress(it))
        except StopIteration:
            break
        assert len(outputs) <= 1000, "no StopIteration after 1000 outputs"
    streams.wait_all()
    return summarize(streams, len(outputs)), streams


def summarize(streams, outputs: int) -> dict:
    """A run on `streams` that gave `outputs` outputs: outputs count, hand-offs checked, the
    checker's error or None, the streams each stage ran on, how many times each stage ran, uses of
    handed-off tensors verified, holds, the objects kept after each release, the most kept at
    once, the drained check's error or None."""
    from tests import streamcheck

    try:
        checked, error = streams.check(), None
    except streamcheck.HandoffError as e:
        checked, error = 0, str(e)
    try:
        streams.check_drained()
        drained = None
    except streamcheck.HandoffError as e:
        drained = str(e)
    stages = {k: sorted(v) for k, v in streams.stage_streams().items()}
    runs: dict[str, int] = {}
    for entry in streams.log:
        if entry[0] == "stage":
            runs[entry[1]] = runs.get(entry[1], 0) + 1
    return {
        "outputs": outputs,
        "checked": checked,
        "error": error,
        "stages": stages,
        "runs": runs,
        "uses": streams.uses_checked,
        "holds": sum(1 for entry in streams.log if entry[0] == "hold"),
        "kept": [entry[1] for entry in streams.log if entry[0] == "kept"],
        "peak": streams.keep_alive.peak,
        "drained": drained,
    }


def outputs_then_stop(pipe, it, steps: int) -> tuple[list, bool]:
    """`steps` outputs, then whether the next `progress()` raises StopIteration."""
    outputs = [pipe.progress(it) for _ in range(steps)]
    try:
        pipe.progress(it)
    except StopIteration:
        return outputs, True
    return outputs, False
