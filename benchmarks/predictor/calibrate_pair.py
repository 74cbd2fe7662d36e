"""The two-rank micro-benchmarks behind `MachineCosts`: two processes of this machine joined by a
gloo process group over loopback TCP (`python -m benchmarks.predictor.calibrate_pair RANK PORT OUT`,
started by `benchmarks.predictor.calibrate`).

They measure what only shows with a peer: the loopback link's transfer curve and CPU per byte, and
the fixed costs of each collective a step issues, run through torchrec's own code at a tiny size (a
sharded EmbeddingBagCollection with one table on each rank: starting its input_dist, waiting for the
splits, waiting for the values, its pooled-embedding all-to-all; DDP's all-reduce). For each, the
wall time, the CPU of the calling thread (host work) and the CPU of the process's other threads
(gloo's) are kept: on two cores shared by two ranks, gloo's threads compete with compute.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.predictor.link import link_from_curve, time_alltoalls

__all__ = ["main", "tiny_model", "tiny_step_seconds"]

_RUNS = 15
_DIM = 4
_FEW, _MANY, _BIG = (2, 8, 1), (26, 8, 1), (8, 256, 40)
"""(tables, samples, ids per sample) of the three modules the collectives are measured on."""


def _timed(fn: Callable[[], Any]) -> tuple[Any, tuple[float, float]]:
    wall, thread = time.perf_counter(), time.thread_time()
    out = fn()
    return out, (time.perf_counter() - wall, time.thread_time() - thread)


def _collectives(
    agree: Callable[[list[float]], list[float]], tables: int, batch: int, pooling: int
) -> dict[str, dict[str, float]]:
    """Per collective of a step on a module of `tables` tables (one feature each, half on each
    rank) and batches of `batch` samples of `pooling` ids: host seconds (the calling thread's CPU)
    and latency (wall beyond)."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan

    configs = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=_DIM, num_embeddings=1000, feature_names=[f"f{i}"])
        for i in range(tables)
    ]
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    sharder = EmbeddingBagCollectionSharder()
    plan = construct_module_sharding_plan(
        ebc,
        per_param_sharding={c.name: table_wise(rank=i % 2) for i, c in enumerate(configs)},
        sharder=sharder,
        world_size=2,
        device_type="cpu",
    )
    dmp = DistributedModelParallel(
        nn.ModuleDict({"ebc": ebc}),
        device=torch.device("cpu"),
        plan=ShardingPlan({"ebc": plan}),
        sharders=[sharder],
    )
    sharded = dmp._dmp_wrapped_module["ebc"]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[c.feature_names[0] for c in configs],
        values=torch.randint(0, 1000, (batch * tables * pooling,)),
        lengths=torch.full((batch * tables,), pooling, dtype=torch.int32),
    )
    grads = torch.zeros(256)
    samples: dict[str, list[tuple[float, float]]] = {}
    for _ in range(_RUNS + 1):
        dist.barrier()
        ctx = sharded.create_context()
        splits, t = _timed(lambda ctx=ctx: sharded.input_dist(ctx, kjt))
        samples.setdefault("start", []).append(t)
        values, t = _timed(splits.wait)
        samples.setdefault("splits", []).append(t)
        data, t = _timed(values.wait)
        samples.setdefault("values", []).append(t)
        with torch.no_grad():
            looked = sharded.compute(ctx, data)
        dist.barrier()
        _, t = _timed(lambda ctx=ctx, looked=looked: sharded.output_dist(ctx, looked).wait())
        samples.setdefault("output", []).append(t)
        dist.barrier()
        _, t = _timed(lambda: dist.all_reduce(grads))
        samples.setdefault("allreduce", []).append(t)
    out = {}
    for name, runs in samples.items():
        fastest = min(runs[1:])  # the fastest round trip: what the collective costs, not the noise
        wall, host = agree(list(fastest))
        out[name] = {"host": host, "latency": max(wall - host, 0.0)}
    return out


def _units(tables: int, batch: int, pooling: int) -> dict[str, float]:
    """What each collective's host work grows with: this rank's ids (start, splits), the ids it
    receives (values), the pooled floats it sends back (output)."""
    ids = tables * batch * pooling / 2  # this rank's ids for the peer's tables, and as many back
    pooled = 2 * batch * (tables / 2) * _DIM
    return {"start": 2 * ids, "splits": 2 * ids, "values": 2 * ids, "output": pooled, "allreduce": 0.0}


def _fit_collectives(few: dict, many: dict, big: dict) -> dict[str, dict[str, float]]:
    """Each collective's host cost as fixed + per feature beyond two + per unit (`_units`)."""
    out = {}
    u_few, u_big = _units(*_FEW), _units(*_BIG)
    for name in few:
        per_feature = max(many[name]["host"] - few[name]["host"], 0.0) / (_MANY[0] - _FEW[0])
        grown = big[name]["host"] - few[name]["host"] - per_feature * (_BIG[0] - _FEW[0])
        span = u_big[name] - u_few[name]
        out[name] = {
            "host": few[name]["host"],
            "latency": few[name]["latency"],
            "host_feature": per_feature,
            "host_unit": max(grown, 0.0) / span if span > 0 else 0.0,
        }
    return out


class _Tiny(nn.Module):
    """The smallest sharded training step: two tables of 4 columns and one linear layer."""

    def __init__(self) -> None:
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

        super().__init__()
        configs = [
            EmbeddingBagConfig(name=f"t{i}", embedding_dim=4, num_embeddings=100, feature_names=[f"f{i}"])
            for i in range(2)
        ]
        self.ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
        self.dense = nn.Linear(4, 8)

    def forward(self, batch: tuple[Any, torch.Tensor]) -> torch.Tensor:
        kjt, dense = batch
        return torch.cat([self.ebc(kjt).values(), self.dense(dense)], dim=1).square().mean()


def tiny_model(world_size: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """`_Tiny` sharded over the default process group (one table per rank), its dense optimizer and
    a batch."""
    from torchrec import KeyedJaggedTensor
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    torch.manual_seed(0)
    model = _Tiny()
    apply_optimizer_in_backward(torch.optim.SGD, model.ebc.parameters(), {"lr": 0.01})
    sharder = EmbeddingBagCollectionSharder()
    per_table = {"t0": table_wise(rank=0), "t1": table_wise(rank=1 % world_size)}
    plan = construct_module_sharding_plan(
        model.ebc, per_param_sharding=per_table, sharder=sharder, world_size=world_size, device_type="cpu"
    )
    dmp = DistributedModelParallel(
        model, device=torch.device("cpu"), plan=ShardingPlan({"ebc": plan}), sharders=[sharder]
    )
    optimizer = torch.optim.SGD(dmp._dmp_wrapped_module.module.dense.parameters(), lr=0.01)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1"], values=torch.arange(16) % 100, lengths=torch.ones(16, dtype=torch.int32)
    )
    return dmp, optimizer, (kjt, torch.rand(8, 4))


def tiny_step_seconds(world_size: int, steps: int = 30) -> float:
    """Median seconds of the plain loop's step on `tiny_model`: what a training step costs at its
    smallest, collectives included."""
    dmp, optimizer, batch = tiny_model(world_size)

    def step() -> None:
        optimizer.zero_grad()
        dmp(batch).backward()
        optimizer.step()

    times = []
    for _ in range(steps + 3):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[3:])


def main(argv: list[str]) -> int:
    rank, port, out = int(argv[0]), argv[1], Path(argv[2])
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:

        def agree(values: list[float]) -> list[float]:
            summed = torch.tensor(values, dtype=torch.float64)
            dist.all_reduce(summed)
            return [v / 2 for v in summed.tolist()]

        collectives = _fit_collectives(*(_collectives(agree, *shape) for shape in (_FEW, _MANY, _BIG)))
        step = agree([tiny_step_seconds(2)])[0]
        send = torch.zeros(2)
        call = _timed(lambda: dist.all_to_all_single(torch.empty_like(send), send))[1][1]
        cpu0, wall0 = time.process_time(), time.perf_counter()
        sizes, seconds = time_alltoalls(
            lambda s, r: dist.all_to_all_single(r, s),
            dist.barrier,
            agree,
            2,
            budget_s=3.0,
            max_bytes=16 << 20,
        )
        cpu, wall = agree([time.process_time() - cpu0, time.perf_counter() - wall0])
        sent = sum(6 * s for s in sizes)  # each size ran 6 times (one untimed), to one peer
        link = link_from_curve(
            "loopback", sizes, [t - call for t in seconds], 1, min(cpu, wall) / max(sent, 1)
        )
        if rank == 0:
            result = {
                "loopback": dataclasses.asdict(link),
                "collectives": collectives,
                "tiny_step_two_ranks": step,
            }
            out.write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
