"""`python -m benchmarks big-tables`: train a DLRM whose tables fill `--total-gb` on disk; peak RSS.

    python -m benchmarks big-tables --total-gb 16 --store-dir /var/tmp/big --steps 50

One process (a gloo world of one), every table on the `tiered` kernel with `--cache-rows` rows
cached, row-wise Adagrad fused into backward (so the store holds weights and the accumulator).
Prints the time to create the stores, steps/s over the timed steps, the cache's hit rate, and the
peak resident set size (VmHWM) against `--rss-limit-gb`; exit status 1 when it is over. Not part of
CI: creating 16 GB takes minutes. The store files are deleted at the end unless `--keep`.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.datasets.utils import Batch
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from benchmarks.measure import machine, peak_rss_bytes
from examples.dlrm.model import unsharded_dlrm
from tiered import TIERED, TieredEmbeddingBagCollectionSharder, TieredOptions

__all__ = ["big_tables"]

_DENSE = 13


def _batch(rows: int, tables: int, batch_size: int, ids: int, gen: torch.Generator) -> Batch:
    lengths = torch.full((tables * batch_size,), ids, dtype=torch.int32)
    values = torch.randint(0, rows, (tables * batch_size * ids,), generator=gen)
    sparse = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{i}" for i in range(tables)], values=values, lengths=lengths
    )
    dense = torch.rand(batch_size, _DENSE, generator=gen)
    return Batch(dense_features=dense, sparse_features=sparse, labels=torch.randint(0, 2, (batch_size,)))


def _train(args: SimpleNamespace) -> int:
    """Create the stores, train, print the figures; 1 when peak RSS exceeds the limit."""
    store = Path(args.store_dir)
    store.mkdir(parents=True, exist_ok=True)
    rows = int(args.total_gb * 2**30 / (args.tables * (args.dim + 1) * 4))  # and Adagrad's float a row
    configs = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=args.dim, num_embeddings=rows, feature_names=[f"f{i}"])
        for i in range(args.tables)
    ]
    dlrm = unsharded_dlrm(configs, embedding_dim=args.dim, dense_hidden=(256,), over_hidden=(256,))
    ebc = dlrm.model.sparse_arch.embedding_bag_collection
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.05})
    sharder = TieredEmbeddingBagCollectionSharder(TieredOptions(store_dir=store, cache_rows=args.cache_rows))
    per_table = {c.name: table_wise(rank=0, compute_kernel=TIERED) for c in configs}
    module_plan = construct_module_sharding_plan(
        ebc, per_param_sharding=per_table, sharder=sharder, world_size=1, device_type="cpu"
    )
    plan = ShardingPlan({"model.sparse_arch.embedding_bag_collection": module_plan})
    print(f"creating {args.tables} tables x {rows:,} rows x dim {args.dim} in {store} ...", flush=True)
    started = time.perf_counter()
    model = DistributedModelParallel(dlrm, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    created_s = time.perf_counter() - started
    on_disk = sum(p.stat().st_size for p in store.glob("*.rows"))
    print(f"created {on_disk / 2**30:.2f} GiB in {created_s:.1f} s; {_so_far()}", flush=True)
    dense = dict(in_backward_optimizer_filter(model.named_parameters()))
    optimizer = KeyedOptimizerWrapper(dense, lambda ps: torch.optim.Adagrad(ps, lr=0.05))
    gen = torch.Generator().manual_seed(0)
    timed_from = None
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            timed_from = time.perf_counter()
        batch = _batch(rows, args.tables, args.batch_size, args.ids, gen)
        loss, _ = model(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    steps_per_s = args.steps / (time.perf_counter() - timed_from)
    stats = [s for m in model.modules() if hasattr(m, "tiered_stats") for s in m.tiered_stats().values()]
    hits, misses = sum(s["hits"] for s in stats), sum(s["misses"] for s in stats)
    if args.checkpoint_dir:
        print(f"peak RSS before the checkpoint {peak_rss_bytes() / 2**20:.0f} MiB", flush=True)
        _checkpoint(model, optimizer, Path(args.checkpoint_dir))
    peak = peak_rss_bytes()
    print(f"total_gb_on_disk {on_disk / 2**30:.2f}")
    print(f"create_seconds {created_s:.1f}")
    print(f"steps_per_s {steps_per_s:.2f}  (batch {args.batch_size}, {args.ids} ids per table per sample)")
    print(f"cache_hit_rate {hits / max(hits + misses, 1):.4f}")
    print(f"peak_rss_mib {peak / 2**20:.0f}  (limit {args.rss_limit_gb * 1024:.0f})")
    return 0 if peak <= args.rss_limit_gb * 2**30 else 1


def _checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Save a checkpoint as the DLRM example does (DCP for the dense part, the store files streamed
    into it), load it back, and print the times and the peak RSS after each."""
    import torch.distributed.checkpoint as dcp

    from examples.dlrm.checkpoint import model_state, tiered_kernels
    from tiered.snapshot import load_stores, save_stores

    shutil.rmtree(directory, ignore_errors=True)
    started = time.perf_counter()
    dcp.save(model_state(model, optimizer, tiered=True), checkpoint_id=directory)
    save_stores(tiered_kernels(model), directory / "stores")
    saved_s = time.perf_counter() - started
    size = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
    print(f"checkpoint_save_seconds {saved_s:.1f}  ({size / 2**30:.2f} GiB; {_so_far()})", flush=True)
    started = time.perf_counter()
    state = model_state(model, optimizer, tiered=True)
    dcp.load(state, checkpoint_id=directory)
    model.load_state_dict(state["model"], strict=False)
    optimizer.load_state_dict(state["dense_optimizer"])
    load_stores(tiered_kernels(model), directory / "stores")
    print(f"checkpoint_load_seconds {time.perf_counter() - started:.1f}  ({_so_far()})", flush=True)
    shutil.rmtree(directory, ignore_errors=True)


def _so_far() -> str:
    return f"peak RSS so far {peak_rss_bytes() / 2**20:.0f} MiB"


def big_tables(*, command: str, **flags: Any) -> int:
    """The `big-tables` subcommand (`flags`: its flags, by `dest`); exit status 1 when the peak RSS is
    over `rss_limit_gb`."""
    args = SimpleNamespace(**flags)
    store = Path(args.store_dir)
    where = store if store.exists() else store.parent
    needed = args.total_gb * (2 if args.checkpoint_dir else 1) * 1.05
    if (free := shutil.disk_usage(where).free / 2**30) < needed:
        raise ValueError(f"{free:.1f} GiB free in {where}, {needed:.1f} needed")
    print(
        f"Command: `{command}`\nMachine: {machine()}; one process, one run: no rounds, no spread", flush=True
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo")
    try:
        return _train(args)
    finally:
        dist.destroy_process_group()
        if not args.keep:
            for path in store.glob("*.rows"):
                path.unlink()
