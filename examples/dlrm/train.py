"""Train DLRM on synthetic or Criteo TSV data, with or without a training pipeline.

    torchrun --standalone --nproc_per_node=2 examples/dlrm/train.py --pipeline prefetch --steps 40

torchrun provides RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous; run without it, this trains as a
single process. The backend is NCCL with device cuda:LOCAL_RANK when CUDA is available, gloo on CPU
otherwise. See README.md for the data options, the flags and multi-node runs.
Exit status: 0 on success, 2 for bad input (flags, data files, malformed lines).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script, sys.path[0] is this folder, whose module names (data, model, ...) would
    # shadow any top-level module of the same name; import from the repository root instead.
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import argparse
import json
import logging
import os
import socket
import warnings

import torch
import torch.distributed as dist

from examples.dlrm.config import PIPELINES, InputError, TrainConfig
from examples.dlrm.criteo_tsv import resolve_paths
from examples.dlrm.elastic import attempt_store
from examples.dlrm.loop import train
from examples.dlrm.store import check_store_dir
from examples.dlrm.synthetic import SyntheticSpec, write_tsv

__all__ = ["format_summary", "main"]


def main(argv: list[str] | None = None) -> int:
    """Parse flags, train on this rank, print the summary on rank 0; returns the exit status."""
    args = _parser().parse_args(argv)
    _quiet_known_warnings()
    rank = int(os.environ.get("RANK", "0"))
    try:
        config = _config(args)
        if args.write_tsv:
            return _write_tsv(args, config)
        _preflight(config)
    except InputError as e:
        # Every rank fails these alike, before any collective: one message is enough.
        if rank == 0:
            print(f"train.py: error: {e}", file=sys.stderr)
        return 2
    device = _init_distributed(args.device)
    try:
        result = train(
            config,
            rank=rank,
            world_size=dist.get_world_size(),
            device=device,
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        )
    except InputError as e:
        where = f" (rank {rank})" if dist.get_world_size() > 1 else ""
        print(f"train.py: error{where}: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # Skip process-group teardown: it can block on peers that are waiting in a collective
        # for this rank, and torchrun stops them once this process is gone.
        os._exit(2)
    except Exception as e:
        if not _peer_failed(e):
            raise
        # Another rank died or failed: one line, not a traceback; torchrun restarts the group
        # (--max-restarts) or reports the rank that failed first.
        print(f"train.py: {e}", file=sys.stderr, flush=True)
        os._exit(1)
    status = _publish(result.summary, args.summary_json) if rank == 0 else 0
    # Tear down together: a rank that destroys its group while a peer's gloo threads still use the
    # connection can abort that peer at exit ("terminate called without an active exception", seen
    # once in CI on rank 1).
    dist.barrier()
    dist.destroy_process_group()
    return status


def _peer_failed(error: BaseException) -> bool:
    try:
        from pipeline import PeerFailedError
    except ImportError:
        return False
    return isinstance(error, PeerFailedError)


def format_summary(summary: dict) -> str:
    """The summary as aligned `key  value` lines under a `summary` heading."""
    width = max(len(k) for k in summary)
    lines = [f"{'=' * 16} summary {'=' * 16}"]
    lines += [f"{key:<{width}}  {value}" for key, value in summary.items()]
    return "\n".join(lines)


def _preflight(config: TrainConfig) -> None:
    config.local_batch_size(int(os.environ.get("WORLD_SIZE", "1")))
    for pattern in (config.data, config.eval_data):
        if pattern:
            resolve_paths(pattern)
    if config.embedding_store is not None:
        check_store_dir(config.embedding_store)


def _write_tsv(args: argparse.Namespace, config: TrainConfig) -> int:
    spec = SyntheticSpec(table_sizes=config.table_sizes, missing_rate=args.missing_rate, seed=config.seed)
    try:
        write_tsv(args.write_tsv, spec, args.lines)
    except OSError as e:
        raise InputError(f"cannot write {args.write_tsv!r}: {e.strerror}") from e
    print(f"wrote {args.lines} lines to {args.write_tsv}")
    return 0


def _publish(summary: dict, json_path: str | None) -> int:
    print(format_summary(summary), flush=True)
    if json_path is None:
        return 0
    try:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2) + "\n")
    except OSError as e:
        print(f"train.py: error: cannot write --summary-json: {e}", file=sys.stderr)
        return 2
    return 0


def _init_distributed(choice: str) -> torch.device:
    use_cuda = choice == "cuda" or (choice == "auto" and torch.cuda.is_available())
    if "RANK" not in os.environ:  # not under torchrun: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    # Under torchrun, a store of this attempt's own (examples/dlrm/elastic.py); else env://.
    store = attempt_store()
    where = {} if store is None else {"store": store, "rank": int(os.environ["RANK"]),
                                      "world_size": int(os.environ["WORLD_SIZE"])}  # fmt: skip
    if use_cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, **where)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", **where)
    return device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        pipeline=args.pipeline,
        batch_size=args.batch_size,
        steps=args.steps,
        epochs=args.epochs,
        embedding_dim=args.embedding_dim,
        num_embeddings=args.num_embeddings,
        pooling=args.pooling,
        dense_hidden=args.dense_hidden,
        over_hidden=args.over_hidden,
        lr=args.lr,
        seed=args.seed,
        data=args.data,
        eval_data=args.eval_data,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
        log_every=args.log_every,
        warmup_steps=args.warmup_steps,
        profile_dir=args.profile,
        profile_steps=args.profile_steps,
        sharding_types=args.sharding_types,
        show_progress=not args.no_progress,
        embedding_store=args.embedding_store,
        cache_rows=args.cache_rows,
        store_mode=args.store_mode,
        cold_store=args.cold_store,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        checkpoint_async=args.checkpoint_async,
        inject_kill=args.inject_kill,
        loss_log=args.loss_log,
    )


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _name_list(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add = p.add_argument
    add("--pipeline", choices=PIPELINES, default=d.pipeline, help="training loop")
    add("--steps", type=int, default=d.steps, help="batches per epoch (with --data: cap; 0: all)")
    add("--epochs", type=int, default=d.epochs)
    add("--batch-size", type=int, default=d.batch_size, help="global; divisible by world size")
    add("--embedding-dim", type=int, default=d.embedding_dim)
    add("--num-embeddings", type=_int_list, default=d.num_embeddings, help="one or 26 sizes")
    add("--pooling", type=int, default=d.pooling, help="mean ids per synthetic feature")
    add("--dense-hidden", type=_int_list, default=d.dense_hidden, help="bottom MLP widths")
    add("--over-hidden", type=_int_list, default=d.over_hidden, help="top MLP widths")
    add("--lr", type=float, default=d.lr)
    add("--seed", type=int, default=d.seed)
    add("--data", help="Criteo TSV file or glob (default: synthetic data)")
    add("--eval-data", help="Criteo TSV file or glob for eval")
    add("--eval-every", type=int, default=d.eval_every, help="steps between evals; 0: none")
    add("--eval-batches", type=int, default=d.eval_batches)
    add("--log-every", type=int, default=d.log_every)
    add("--warmup-steps", type=int, default=d.warmup_steps, help="left out of throughput")
    add("--profile", metavar="DIR", help="write DIR/rank{r}.json chrome traces")
    add("--profile-steps", type=int, default=d.profile_steps)
    add("--sharding-types", type=_name_list, help="e.g. table_wise,column_wise (default by device)")
    add("--embedding-store", metavar="DIR", help="tables on disk in DIR (tiered kernel, CPU)")
    add("--cache-rows", type=int, metavar="N", help="with --embedding-store: RAM rows per table shard")
    add("--store-mode", choices=("create", "open"), default=d.store_mode,
        help="with --embedding-store: new stores from initial weights, or reuse existing ones")  # fmt: skip
    add("--cold-store", action="store_true", help="with --embedding-store: every miss reads the disk")
    add("--checkpoint-dir", metavar="DIR", help="save sharded checkpoints here; resume from the newest")
    add("--checkpoint-every", type=int, metavar="N", default=d.checkpoint_every,
        help="with --checkpoint-dir: steps between checkpoints (0: after the last step only)")  # fmt: skip
    add("--checkpoint-async", action="store_true", help="write checkpoints behind training")
    add("--inject-kill", metavar="RANK:step|save:N", help="SIGKILL a rank once, for demos and tests")
    add("--loss-log", metavar="PATH", help="append every step's exact loss on every rank here")
    add("--device", choices=("auto", "cpu", "cuda"), default="auto")
    add("--summary-json", metavar="PATH", help="also write the summary here")
    add("--no-progress", action="store_true", help="no progress bar or periodic reports")
    add("--write-tsv", metavar="PATH", help="write synthetic rows as Criteo TSV and exit")
    add("--lines", type=int, default=48, help="lines for --write-tsv")
    add("--missing-rate", type=float, default=0.1, help="empty fields for --write-tsv")
    return p


def _quiet_known_warnings() -> None:
    # Deprecation notices from inside torch/torchrec that a user of this example cannot act on.
    warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)


if __name__ == "__main__":
    sys.exit(main())
