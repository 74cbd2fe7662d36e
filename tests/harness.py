"""Run a test body on N gloo ranks in spawned processes and collect every rank's result.

`run_ranks(fn, world_size=2)` spawns one process per rank, joins them into a gloo process group over
a free local port and calls `fn(rank, world_size, *args)` in each. It returns the list of per-rank
return values. A rank that raises fails the call with that rank's own traceback; a rank that does not
finish within `timeout` seconds fails the call instead of blocking CI. `fn` must be importable by
name (a module-level function), since ranks are spawned, not forked.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["RankError", "RankTimeout", "free_port", "run_ranks"]


class RankError(RuntimeError):
    """A rank raised; the message carries its traceback."""


class RankTimeout(RuntimeError):
    """A rank did not finish within the harness timeout."""


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank: int, world_size: int, port: int, out_dir: str, args: tuple, backend: str) -> None:
    import torch
    import torch.distributed as dist

    # Two ranks share two cores: one intra-op thread each keeps them from thrashing, and makes
    # results independent of how many threads a reduction happened to use.
    torch.set_num_threads(1)
    out = Path(out_dir)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
        )
        result = fn(rank, world_size, *args)
        torch.save(result, out / f"rank{rank}.pt")
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        os._exit(1)  # skip process-group teardown, which can block on peers that are gone
    if dist.is_initialized():
        dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    timeout: float = 120.0,
    args: Sequence[Any] = (),
    grace: float = 5.0,
    backend: str = "gloo",
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` ranks (gloo; or nccl, rank r on GPU r).

    Args:
        fn: module-level function; its return value must be picklable by `torch.save`.
        world_size: number of ranks.
        timeout: seconds for all ranks to finish, from spawn.
        args: extra positional arguments passed to every rank.
        grace: seconds the other ranks get to finish after one rank failed, before they are killed
            (they are usually blocked in a collective with the failed rank).
        backend: the process group's backend; "nccl" needs a GPU per rank.

    Returns:
        The per-rank return values, indexed by rank.

    Raises:
        RankError: a rank raised or died; the message holds every failed rank's traceback.
        RankTimeout: some rank was still running after `timeout` seconds.
    """
    import torch

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="ranks-") as out_dir:
        port = free_port()
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(fn, rank, world_size, port, out_dir, tuple(args), backend),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        failed_at: float | None = None
        try:
            while any(p.is_alive() for p in procs):
                now = time.monotonic()
                if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                    failed_at = now
                if now > deadline or (failed_at is not None and now - failed_at > grace):
                    break
                time.sleep(0.05)
        finally:
            hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
        errors = _collect_errors(Path(out_dir), procs)
        if errors:
            raise RankError("\n".join(errors))
        if hung:
            raise RankTimeout(
                f"rank(s) {hung} of {world_size} still running after {timeout:.0f}s "
                f"running {fn.__name__}; killed"
            )
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def _collect_errors(out: Path, procs: list) -> list[str]:
    errors = []
    for rank, p in enumerate(procs):
        err = out / f"rank{rank}.err"
        if err.exists():
            errors.append(f"--- rank {rank} raised:\n{err.read_text()}")
        elif p.exitcode not in (0, None, -9):
            errors.append(f"--- rank {rank} died with exit code {p.exitcode}")
    return errors
