"""Tables larger than the memory given to them: ~1 GiB of embedding tables on disk (the tiered
kernel, row-wise Adagrad, a small cache), trained through PrefetchTrainPipelineSparseDist, grow the
process's peak RSS by at most an eighth of the tables' size: the proportion of `make bench-big`'s
"16 GB in under 2 GB RSS", at a size CI affords (`python -m benchmarks big-tables`, docs/tiered.md).

One rank (a gloo world of one) in a process of its own. Peak RSS (VmHWM) is measured from where it
was before training: the imports alone take several hundred MiB, and creating the stores writes
64 MiB chunks (tiered/store.py), a fixed cost checked on its own (under a quarter of the tables).
"""

from __future__ import annotations

import tempfile

import pytest

from tests.harness import pytest_timeout, run_ranks

GIB = 2**30
TOTAL_GB, TABLES, DIM, CACHE_ROWS, BATCH, IDS, STEPS = 1.0, 4, 64, 20_000, 256, 4, 20
TIMEOUT = 240
pytestmark = [pytest.mark.timeout(pytest_timeout(TIMEOUT)), pytest.mark.slow]


def _batches(rows: int, n: int) -> list:
    import torch
    from torchrec import KeyedJaggedTensor
    from torchrec.datasets.utils import Batch

    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        lengths = torch.full((TABLES * BATCH,), IDS, dtype=torch.int32)
        values = torch.randint(0, rows, (TABLES * BATCH * IDS,), generator=gen)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{i}" for i in range(TABLES)], values=values, lengths=lengths
        )
        labels = torch.randint(0, 2, (BATCH,), generator=gen).float()
        out.append(
            Batch(dense_features=torch.rand(BATCH, 13, generator=gen), sparse_features=kjt, labels=labels)
        )
    return out


def peak_rss_bytes() -> int:
    """This process's peak resident set size (VmHWM of /proc/self/status), in bytes."""
    from pathlib import Path

    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _train_big(rank: int, world_size: int, store: str) -> dict:
    from pathlib import Path

    import torch
    from torchrec import EmbeddingBagConfig
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    import pipeline
    from examples.dlrm.model import unsharded_dlrm
    from tests.models import run_to_end
    from tiered import TIERED, TieredEmbeddingBagCollectionSharder, TieredOptions

    rows = int(TOTAL_GB * GIB / (TABLES * (DIM + 1) * 4))  # weights and Adagrad's one float a row
    configs = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=rows, feature_names=[f"f{i}"])
        for i in range(TABLES)
    ]
    data = _batches(rows, STEPS)
    dlrm = unsharded_dlrm(configs, embedding_dim=DIM, dense_hidden=(64,), over_hidden=(64,))  # tables on meta
    ebc = dlrm.model.sparse_arch.embedding_bag_collection
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.05})
    sharder = TieredEmbeddingBagCollectionSharder(TieredOptions(store_dir=store, cache_rows=CACHE_ROWS))
    plan = construct_module_sharding_plan(
        ebc,
        per_param_sharding={c.name: table_wise(rank=0, compute_kernel=TIERED) for c in configs},
        sharder=sharder,
        world_size=1,
        device_type="cpu",
    )
    before_create = peak_rss_bytes()
    model = DistributedModelParallel(
        dlrm,
        device=torch.device("cpu"),
        plan=ShardingPlan({"model.sparse_arch.embedding_bag_collection": plan}),
        sharders=[sharder],
    )
    dense = dict(in_backward_optimizer_filter(model.named_parameters()))
    opt = KeyedOptimizerWrapper(dense, lambda ps: torch.optim.SGD(ps, lr=0.05))
    created = peak_rss_bytes()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux)
    before = peak_rss_bytes()
    pipe = pipeline.PrefetchTrainPipelineSparseDist(model, opt, torch.device("cpu"))
    outputs = run_to_end(pipe, iter(data))
    stats = [s for m in model.modules() if hasattr(m, "tiered_stats") for s in m.tiered_stats().values()]
    return {
        "on_disk": sum(p.stat().st_size for p in Path(store).glob("*.rows")),
        "growth": peak_rss_bytes() - before,
        "create_growth": created - before_create,
        "outputs": len(outputs),
        "finite": all(bool(torch.isfinite(out[0]).all()) for out in outputs),
        "hits": sum(s["hits"] for s in stats),
        "misses": sum(s["misses"] for s in stats),
    }


def test_a_gib_of_tables_trains_through_prefetch_in_an_eighth_of_it():
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="big-tables-") as store:
        (r,) = run_ranks(_train_big, 1, timeout=TIMEOUT, args=(store,))
    assert r["on_disk"] >= 0.95 * TOTAL_GB * GIB, r
    assert r["outputs"] == STEPS and r["finite"], r
    assert r["misses"] > 0 and r["hits"] > 0, r  # rows came from the files, through the cache
    assert r["growth"] < r["on_disk"] / 8, f"training grew the peak RSS {r['growth'] / 2**20:.0f} MiB: {r}"
    assert r["create_growth"] < r["on_disk"] / 4, (
        f"creating the stores took {r['create_growth'] / 2**20:.0f} MiB"
    )
