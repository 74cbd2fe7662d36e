"""`python -m benchmarks agreement`: what the ranks' per-batch agreement costs at 2-16 CPU ranks.

Each rank runs the pipeline's own vote (`pipeline.ranks.Votes`: one small all_reduce on a gloo group
of its own) back to back, issued and waited at once, which is its latency without the step of
overlap the pipeline gives it (issued at fetch, waited a step later). Beside it, for comparison, the
request per rank to rank 0's store that the agreement used before (`store.add(key, 0)`: every rank's
request served by one process). Ranks are local processes over loopback: on a machine with fewer
cores than ranks the figures include the ranks' scheduling, which is what grows first.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from benchmarks.launch import free_port
from benchmarks.report import markdown_table, stamp, text_table, write

__all__ = ["agreement"]

_WARMUP = 20


def agreement(*, world_sizes: list[int], votes: int, command: str, json: str | None, md: str | None) -> int:
    rows, result = [], {"command": command, "machine": platform.processor() or platform.machine(), "runs": {}}
    for world in world_sizes:
        per_rank = _measure(world, votes)
        result["runs"][world] = per_rank
        keys = ("vote_us", "vote_p90_us", "vote_cpu_us", "store_us")
        rows.append([world, *(statistics.median(r[k] for r in per_rank) for k in keys)])
    columns = ["ranks", "vote us (median)", "vote us (p90)", "vote CPU us", "store request us (median)"]
    print(text_table(columns, [[f"{v:.0f}" if isinstance(v, float) else v for v in r] for r in rows]))
    lines = [*stamp(command), "", f"{votes} votes per world size, local ranks over loopback.", ""]
    lines += markdown_table(columns, [[f"{v:.0f}" if isinstance(v, float) else v for v in r] for r in rows])
    write(result, "\n".join(lines) + "\n", json_path=json, md_path=md)
    return 0


def _measure(world: int, votes: int) -> list[dict[str, float]]:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="bench-agreement-") as tmp:
        mp.start_processes(_rank, args=(world, port, votes, tmp), nprocs=world, start_method="spawn")
        return [json.loads((Path(tmp) / f"{r}.json").read_text()) for r in range(world)]


def _rank(rank: int, world: int, port: int, votes: int, out: str) -> None:
    os.environ.update(OMP_NUM_THREADS="1")
    import torch.distributed as dist

    from pipeline.ranks import Status
    from pipeline.ranks.protocol import Votes

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        voter = Votes(timeout=datetime.timedelta(seconds=120))
        for _ in range(_WARMUP):
            voter.vote(Status.HAVE).wait()
        dist.barrier()
        latency, cpu = [], time.process_time()
        for _ in range(votes):
            start = time.perf_counter()
            assert voter.vote(Status.HAVE).wait()[Status.HAVE] == world
            latency.append(time.perf_counter() - start)
        cpu = time.process_time() - cpu
        dist.barrier()
        requests = []
        for _ in range(votes):
            start = time.perf_counter()
            store.add("bench-agreement/events", 0)
            requests.append(time.perf_counter() - start)
        dist.barrier()
        latency.sort()
        record: dict[str, Any] = {
            "vote_us": 1e6 * statistics.median(latency),
            "vote_p90_us": 1e6 * latency[int(0.9 * (len(latency) - 1))],
            "vote_cpu_us": 1e6 * cpu / votes,
            "store_us": 1e6 * statistics.median(requests),
        }
        (Path(out) / f"{rank}.json").write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()
