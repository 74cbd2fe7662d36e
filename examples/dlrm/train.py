"""Train DLRM on synthetic or Criteo TSV data, with or without a training pipeline.

    torchrun --standalone --nproc_per_node=2 examples/dlrm/train.py --pipeline prefetch --steps 40

torchrun provides RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous; run without it, this trains as a
single process. The backend is NCCL with device cuda:LOCAL_RANK where every local rank has a GPU of
its own, gloo on the CPU otherwise (examples/dlrm/devices.py). See README.md for the data options,
the flags and multi-node runs.
Exit status: 0 on success, 2 for bad input (flags, data files, malformed lines): one paragraph
starting `train.py: error:` from the rank that found it, and nothing else from the others.

torch, torchrec and the training modules are imported only after the flags are parsed, so that
`--help` and a mistyped flag answer at once.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script, sys.path[0] is this folder, whose module names (data, model, ...) would
    # shadow any top-level module of the same name; import from the repository root instead.
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import argparse
import gc
import json
import os
import socket
from typing import Any, NoReturn

from examples.dlrm.config import PIPELINES, PREFETCH_AHEAD, SCHEDULES, InputError, TrainConfig

__all__ = ["format_summary", "main"]


def main(argv: list[str] | None = None) -> int:
    """Parse flags, train on this rank, print the summary on rank 0; returns the exit status."""
    args = _parser().parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        config = _config(args)
        if args.write_tsv:
            return _write_tsv(args, config)
        _preflight(config, args.device)
        if args.compare:
            from examples.dlrm.compare import check_comparable

            check_comparable(config)
    except InputError as e:
        # Every rank fails these alike, before any collective: one message is enough.
        _rank_0_says(f"train.py: error: {e}")
        return 2
    _quiet_known_warnings()
    import torch.distributed as dist

    from examples.dlrm.errors import train_or_exit

    device = _init_distributed(args.device)
    world_size = dist.get_world_size()
    result = train_or_exit(config, rank=rank, world_size=world_size, device=device)
    if args.compare:
        from examples.dlrm.compare import comparison, plain_config

        plain = train_or_exit(plain_config(config), rank=rank, world_size=world_size, device=device)
        result.summary.update(comparison(result.summary, plain.summary))
    status = _publish(result.summary, args.summary_json) if rank == 0 else 0
    # Tear down together: a rank that destroys its group while a peer's gloo threads still use the
    # connection can abort that peer at exit ("terminate called without an active exception", seen
    # in CI on rank 1, twice). Free the pipeline first: it may hold the work objects of collectives
    # still in flight (the next batch's input all-to-alls) in reference cycles, which the
    # interpreter would otherwise free during its own shutdown, after the groups are gone.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return status


def format_summary(summary: dict) -> str:
    """The summary as aligned `key  value` lines under a `summary` heading."""
    width = max(len(k) for k in summary)
    lines = [f"{'=' * 16} summary {'=' * 16}"]
    lines += [f"{key:<{width}}  {value}" for key, value in summary.items()]
    return "\n".join(lines)


def _preflight(config: TrainConfig, device: str) -> None:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    config.local_batch_size(world_size)
    if device == "cuda":
        from examples.dlrm.devices import rank_device

        rank_device(
            device, int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        )
    for pattern in (config.data, config.eval_data):
        if pattern:
            from examples.dlrm.criteo_tsv import resolve_paths

            resolve_paths(pattern)
    if config.embedding_store is not None:
        from examples.dlrm.store import check_cache_rows, check_store_dir, check_store_world

        check_store_dir(config.embedding_store)
        check_cache_rows(config)
        if config.store_mode == "open":
            check_store_world(config, world_size=world_size)


def _write_tsv(args: argparse.Namespace, config: TrainConfig) -> int:
    from examples.dlrm.synthetic import SyntheticSpec, write_tsv

    spec = SyntheticSpec(table_sizes=config.table_sizes, missing_rate=args.missing_rate, seed=config.seed)
    try:
        write_tsv(args.write_tsv, spec, args.lines)
    except OSError as e:
        raise InputError(f"cannot write {args.write_tsv!r}: {e.strerror}") from e
    print(f"wrote {args.lines} lines to {args.write_tsv}")
    return 0


def _publish(summary: dict, json_path: str | None) -> int:
    from examples.dlrm.compare import verdict

    print(format_summary(summary), flush=True)
    line = verdict(summary)
    if line:
        print(line, flush=True)
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


def _init_distributed(choice: str) -> Any:
    import torch
    import torch.distributed as dist

    from examples.dlrm.devices import rank_device

    if "RANK" not in os.environ:  # not under torchrun: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    # cuda:LOCAL_RANK only where every local rank has a GPU of its own (examples/dlrm/devices.py).
    use_cuda = rank_device(choice, local_rank, local_world) != "cpu"
    if choice == "auto" and not use_cuda and torch.cuda.is_available() and local_rank == 0:
        gpus = torch.cuda.device_count()
        note = f"{local_world} local ranks and {gpus} GPU(s): training on the CPU (gloo)"
        print(f"train.py: {note}; start one rank per GPU to train on them", file=sys.stderr)
    from examples.dlrm.elastic import attempt_store

    # Under torchrun, a store of this attempt's own (examples/dlrm/elastic.py); else env://.
    store = attempt_store()
    where = (
        {}
        if store is None
        else {"store": store, "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}
    )
    if use_cuda:
        device = torch.device("cuda", local_rank)
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
        input_dist_schedule=args.input_dist_schedule,
        prefetch_ahead=args.prefetch_ahead,
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


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line (no usage block), printed by rank 0 only: under torchrun
    every rank parses the same flags."""

    def print_help(self, file: Any = None) -> None:
        if os.environ.get("RANK", "0") == "0":
            super().print_help(file)

    def error(self, message: str) -> NoReturn:
        _rank_0_says(f"{self.prog}: error: {message} (see --help)")
        sys.exit(2)


def _rank_0_says(message: str) -> None:
    """Print `message` on rank 0; the other ranks, which fail alike, print nothing and wait a little:
    torchrun stops every worker as soon as one has exited, and rank 0 might not have printed yet."""
    if os.environ.get("RANK", "0") == "0":
        print(message, file=sys.stderr, flush=True)
    else:
        import time

        time.sleep(2)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default only where there is one to show (not None, not an off switch)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = _Parser(prog="train.py", description=__doc__.split("\n\n")[0], formatter_class=_HelpFormatter)
    add = p.add_argument

    def widths(values: tuple[int, ...]) -> str:  # argparse passes a str default through `type`
        return ",".join(map(str, values))

    add("--pipeline", choices=PIPELINES, default=d.pipeline, help="training loop")
    add(
        "--input-dist-schedule",
        choices=SCHEDULES,
        default=d.input_dist_schedule,
        help="sparse-dist/prefetch: when the next batch's all-to-alls run (late: torchrec's order)",
    )
    add(
        "--prefetch-ahead",
        choices=PREFETCH_AHEAD,
        default=d.prefetch_ahead,
        help="prefetch: the prefetch of batch i+1 during backward of i (auto: the watch decides on CPU)",
    )
    add("--steps", type=int, default=d.steps, help="batches per epoch (with --data: cap; 0: all)")
    add("--epochs", type=int, default=d.epochs, help="passes over the data")
    add("--batch-size", type=int, default=d.batch_size, help="global; divisible by world size")
    add("--embedding-dim", type=int, default=d.embedding_dim, help="width of every table")
    add("--num-embeddings", type=_int_list, default=widths(d.num_embeddings), help="one or 26 sizes")
    add("--pooling", type=int, default=d.pooling, help="mean ids per synthetic feature")
    add("--dense-hidden", type=_int_list, default=widths(d.dense_hidden), help="bottom MLP widths")
    add("--over-hidden", type=_int_list, default=widths(d.over_hidden), help="top MLP widths")
    add("--lr", type=float, default=d.lr, help="learning rate of both Adagrads")
    add("--seed", type=int, default=d.seed, help="initial weights and synthetic data")
    add("--data", help="Criteo TSV file or glob (default: synthetic data)")
    add("--eval-data", help="Criteo TSV file or glob for eval")
    add("--eval-every", type=int, default=d.eval_every, help="steps between evals; 0: none")
    add("--eval-batches", type=int, default=d.eval_batches, help="batches per eval pass")
    add("--log-every", type=int, default=d.log_every, help="steps between reports")
    add("--warmup-steps", type=int, default=d.warmup_steps, help="left out of throughput and step time")
    add("--profile", metavar="DIR", help="write DIR/rank{r}.json chrome traces")
    add("--profile-steps", type=int, default=d.profile_steps, help="steps recorded by --profile")
    add("--sharding-types", type=_name_list, help="e.g. table_wise,column_wise (default by device)")
    add("--embedding-store", metavar="DIR", help="tables on disk in DIR (tiered kernel, CPU)")
    add("--cache-rows", type=int, metavar="N", help="with --embedding-store: RAM rows per table shard")
    add(
        "--store-mode",
        choices=("create", "open"),
        default=d.store_mode,
        help="with --embedding-store: new stores from initial weights, or reuse existing ones",
    )
    add("--cold-store", action="store_true", help="with --embedding-store: every miss reads the disk")
    add("--compare", choices=("plain",), help="then train the plain loop alike and compare step times")
    add("--checkpoint-dir", metavar="DIR", help="save sharded checkpoints here; resume from the newest")
    add(
        "--checkpoint-every",
        type=int,
        metavar="N",
        default=d.checkpoint_every,
        help="with --checkpoint-dir: steps between checkpoints (0: after the last step only)",
    )
    add("--checkpoint-async", action="store_true", help="write checkpoints behind training")
    add("--inject-kill", metavar="RANK:step|save:N", help="SIGKILL a rank once, for demos and tests")
    add("--loss-log", metavar="PATH", help="append every step's exact loss on every rank here")
    add(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: cuda where each local rank has a GPU",
    )
    add("--summary-json", metavar="PATH", help="also write the summary here")
    add("--no-progress", action="store_true", help="no progress bar or periodic reports")
    add("--write-tsv", metavar="PATH", help="write synthetic rows as Criteo TSV and exit")
    add("--lines", type=int, default=48, help="lines for --write-tsv")
    add("--missing-rate", type=float, default=0.1, help="empty fields for --write-tsv")
    return p


def _quiet_known_warnings() -> None:
    import logging
    import warnings

    # Deprecation notices from inside torch/torchrec that a user of this example cannot act on.
    warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)


if __name__ == "__main__":
    sys.exit(main())
