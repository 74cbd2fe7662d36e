"""The two-rank micro-benchmarks behind `MachineCosts`: two processes of this machine joined by a
gloo process group over loopback TCP (`python -m pipeline.predictor.calibrate_pair RANK PORT OUT`,
started by `pipeline.predictor.calibrate`).

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

from pipeline.predictor.link import link_from_curve, time_alltoalls

__all__ = ["main"]

_RUNS = 15


def _timed(fn: Callable[[], Any]) -> tuple[Any, tuple[float, float]]:
    wall, thread = time.perf_counter(), time.thread_time()
    out = fn()
    return out, (time.perf_counter() - wall, time.thread_time() - thread)


def _collectives(agree: Callable[[list[float]], list[float]]) -> dict[str, dict[str, float]]:
    """Per collective of a step: host seconds (the calling thread's CPU) and latency (wall beyond)."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan

    configs = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=4, num_embeddings=100, feature_names=[f"f{i}"])
        for i in range(2)
    ]
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    sharder = EmbeddingBagCollectionSharder()
    plan = construct_module_sharding_plan(
        ebc,
        per_param_sharding={"t0": table_wise(rank=0), "t1": table_wise(rank=1)},
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
        keys=["f0", "f1"], values=torch.arange(16) % 100, lengths=torch.ones(16, dtype=torch.int32)
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
        wall, host = agree([statistics.median(r[k] for r in runs[1:]) for k in range(2)])
        out[name] = {"host": host, "latency": max(wall - host, 0.0)}
    return out


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

        collectives = _collectives(agree)
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
        sent = sum(6 * s for s in sizes)  # each size ran 6 times, to one peer
        link = link_from_curve(
            "loopback", sizes, [t - call for t in seconds], 1, min(cpu, wall) / max(sent, 1)
        )
        if rank == 0:
            out.write_text(json.dumps({"loopback": dataclasses.asdict(link), "collectives": collectives}))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
