"""The micro-benchmarks behind `MachineCosts`: `python -m benchmarks.predictor.calibrate OUT THREADS`
(started by `benchmarks.predictor.machine.machine_costs`, in a process of its own, so that it can make
its own one-rank process group and time on an otherwise idle interpreter).

Each figure is the fastest of a few runs at each of a few sizes, fitted by least squares as a fixed
cost plus costs per unit (`_fit`). The lookups are torchrec's own (a sharded EmbeddingBagCollection
at one rank on the fused kernel, SGD in backward). What needs a peer (the loopback link, the fixed
costs of each collective) is measured by two more processes (`benchmarks.predictor.calibrate_pair`).
About 10-20 s in all.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.predictor.calibrate_pair import tiny_model, tiny_step_seconds
from benchmarks.predictor.dense import time_dense

__all__ = ["main"]

_ROWS = 10_000


def _fastest(fn: Callable[[], object], runs: int = 9) -> float:
    """The fastest of `runs` calls (after one untimed): the cost itself, not what other work on a
    shared machine added to it."""
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _fit(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Coefficients of `ys ~ rows @ c` minimizing the relative errors (small sizes count as much as
    large ones), each clipped at 0 (a cost is never negative)."""
    a = torch.tensor(rows, dtype=torch.float64)
    y = torch.tensor(ys, dtype=torch.float64)
    weight = 1.0 / y.clamp(min=1e-9)
    solution = torch.linalg.lstsq(a * weight[:, None], (y * weight)[:, None]).solution[:, 0]
    return [max(float(c), 0.0) for c in solution]


def _kjt(tables: int, batch: int, pooling: int):
    from torchrec import KeyedJaggedTensor

    lengths = torch.full((tables * batch,), pooling, dtype=torch.int32)
    values = torch.randint(0, _ROWS, (int(lengths.sum()),))
    return KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{i}" for i in range(tables)], values=values, lengths=lengths
    )


def _sharded_ebc(tables: int, dim: int) -> nn.Module:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    configs = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=_ROWS, feature_names=[f"f{i}"])
        for i in range(tables)
    ]
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.01})
    sharder = EmbeddingBagCollectionSharder()
    per_table = {c.name: table_wise(rank=0) for c in configs}
    plan = construct_module_sharding_plan(
        ebc, per_param_sharding=per_table, sharder=sharder, world_size=1, device_type="cpu"
    )
    dmp = DistributedModelParallel(
        nn.ModuleDict({"ebc": ebc}),
        device=torch.device("cpu"),
        plan=ShardingPlan({"ebc": plan}),
        sharders=[sharder],
    )
    return dmp._dmp_wrapped_module["ebc"]


def _lookups() -> dict[str, float]:
    """Lookup forward and backward (per call, table, id, id x column), and torchrec's host costs
    of starting a module's input_dist and of its output all-to-all's bookkeeping."""
    rows, fwd, bwd, calls, outs = [], [], [], [], []
    for tables, dim, batch, pooling in (
        (1, 4, 16, 1),
        (26, 16, 128, 1),
        (8, 4, 256, 40),
        (8, 64, 256, 40),
        (26, 4, 256, 20),
    ):
        ebc = _sharded_ebc(tables, dim)
        kjt = _kjt(tables, batch, pooling)
        ctx = ebc.create_context()
        data = ebc.input_dist(ctx, kjt).wait().wait()
        ids = kjt.values().numel()

        def forward_backward(ctx=ctx, data=data, ebc=ebc) -> None:
            looked_up = ebc.compute(ctx, data)
            torch.autograd.backward(looked_up, [torch.ones_like(t) for t in looked_up])

        with torch.no_grad():
            fwd.append(_fastest(lambda ctx=ctx, data=data, ebc=ebc: ebc.compute(ctx, data)))
            looked = ebc.compute(ctx, data)
            out = _fastest(lambda ebc=ebc, ctx=ctx, looked=looked: ebc.output_dist(ctx, looked).wait())
        bwd.append(max(_fastest(forward_backward) - fwd[-1], 1e-9))
        rows.append([1.0, tables, ids, ids * dim])
        calls.append(
            _fastest(lambda ebc=ebc, kjt=kjt: ebc.input_dist(ebc.create_context(), kjt).wait().wait())
        )
        outs.append(out)
    f, b = _fit(rows, fwd), _fit(rows, bwd)
    return {
        "lookup_fwd_call": f[0],
        "lookup_fwd_table": f[1],
        "lookup_fwd_id": f[2],
        "lookup_fwd_elem": f[3],
        "lookup_bwd_call": b[0],
        "lookup_bwd_table": b[1],
        "lookup_bwd_id": b[2],
        "lookup_bwd_elem": b[3],
        "input_dist_call": min(calls),
        "output_call": min(outs),
    }


def _permutes() -> dict[str, float]:
    rows, ys = [], []
    for tables, batch, pooling in ((2, 16, 1), (26, 256, 1), (16, 256, 20), (26, 256, 60)):
        kjt = _kjt(tables, batch, pooling)
        order = list(reversed(range(tables)))
        rows.append([1.0, kjt.values().numel()])
        ys.append(_fastest(lambda kjt=kjt, order=order: kjt.permute(order)))
    call, per_id = _fit(rows, ys)
    return {"permute_call": call, "permute_id": per_id}


def _dense() -> dict[str, float]:
    rows, ys = [], []
    for layers, width, batch in ((1, 8, 16), (8, 16, 64), (2, 64, 128), (4, 256, 256), (2, 1024, 256)):
        mlp = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)])
        x = torch.rand(batch, width)
        target = torch.rand(batch, width)

        def step(mlp=mlp, x=x, target=target) -> None:
            loss = nn.functional.binary_cross_entropy_with_logits(mlp(x), target)
            loss.backward()

        rows.append([2.0 * layers + 1, 6.0 * batch * width * width * layers])  # 2 forward + 4 backward
        ys.append(_fastest(step))
    op, flop = _fit(rows, ys)
    rows, ys = [], []
    for tensors, size in ((2, 1000), (20, 1000), (4, 1_000_000)):
        params = [nn.Parameter(torch.rand(size)) for _ in range(tensors)]
        for p in params:
            p.grad = torch.rand(size)
        optimizer = torch.optim.SGD(params, lr=0.01)
        rows.append([tensors, tensors * size])
        ys.append(_fastest(optimizer.step))
    per_tensor, per_param = _fit(rows, ys)
    return {"dense_op": op, "dense_flop": flop, "optimizer_tensor": per_tensor, "optimizer_param": per_param}


def _checks_and_calls() -> dict[str, float]:
    from pipeline.ranks.kjt_check import KJTCheck

    check = KJTCheck(None)
    rows, ys = [], []
    for tables, batch, pooling in ((4, 64, 1), (26, 256, 40)):
        kjt = _kjt(tables, batch, pooling)
        rows.append([1.0, kjt.values().numel()])
        ys.append(_fastest(lambda kjt=kjt: check.check_kjt(kjt)))
    _, per_id = _fit(rows, ys)
    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=60))
    empty = torch.empty(0)
    call = _fastest(lambda: pg.alltoall_base(empty, empty, [], []).wait(), runs=50)
    return {"kjt_check_id": per_id, "a2a_call": call}


_LAUNCHER = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def _pair() -> dict[str, object]:
    """The two-rank measurements (`benchmarks.predictor.calibrate_pair`), in two processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    with tempfile.TemporaryDirectory(prefix="pipeline-pair-") as tmp:
        out = Path(tmp) / "pair.json"
        argv = [sys.executable, "-m", "benchmarks.predictor.calibrate_pair"]
        # A launcher's variables (torchrun's TORCHELASTIC_USE_AGENT_STORE, RANK, MASTER_PORT...)
        # would make the pair rendezvous with an agent that is not there: the pair gets its own.
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER and not k.startswith("TORCHELASTIC")}
        procs = [subprocess.Popen([*argv, str(rank), port, str(out)], env=env) for rank in range(2)]
        try:
            codes = [p.wait(timeout=240) for p in procs]
        finally:
            for p in procs:  # a pair that hangs must not outlive the calibration
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(codes):
            raise RuntimeError(f"the two-rank micro-benchmarks failed (exit codes {codes})")
        return json.loads(out.read_text())


def main(argv: list[str]) -> int:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    out, threads = Path(argv[0]), int(argv[1])
    torch.set_num_threads(threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        costs = {**_lookups(), **_permutes(), **_dense(), **_checks_and_calls()}
        costs["tiny_step_one_rank"] = tiny_step_seconds(1)
        model, _, batch = tiny_model(1)
        dense = time_dense(model, batch)
        costs["tiny_dense"] = dense.forward + dense.backward if dense is not None else 0.0
    finally:
        dist.destroy_process_group()
    pair = _pair()
    costs["loopback"] = pair["loopback"]
    costs["tiny_step_two_ranks"] = pair["tiny_step_two_ranks"]
    costs.update(pair["collectives"])
    out.write_text(json.dumps(costs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
