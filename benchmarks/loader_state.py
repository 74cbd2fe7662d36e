"""The price of a checkpoint without a drain: process CPU time per step with the pipeline keeping
each batch's dataloader state (an iterator with `state_dict()`) against an iterator without one.

    python -m benchmarks.loader_state --rounds 9 --steps 60

One process (a gloo world of one), the DLRM example's model and synthetic batches (pre-generated,
so data making is not timed), `TrainPipelineSparseDist`. Each round trains `--steps` batches from
each of three iterators over the same batches, in a rotating order: `plain` (no `state_dict()`:
nothing is captured), `positioned` (the example's iterator: a dict of two ints per fetch) and
`stateful` (torchdata's `StatefulDataLoader`, `num_workers=0`). Prints the median over rounds of the
per-round ratio of CPU time per step to `plain`'s, and the direct cost of one `state_dict()` call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import timeit

import torch
import torch.distributed as dist

__all__ = ["main"]


class _Plain:
    def __init__(self, batches: list) -> None:
        self._it = iter(batches)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._it)


def _iterators(batches: list) -> dict:
    from torchdata.stateful_dataloader import StatefulDataLoader

    from examples.dlrm.data import Positioned

    return {
        "plain": lambda: _Plain(batches),
        "positioned": lambda: Positioned(iter(batches), epoch=0, batch=0),
        "stateful": lambda: iter(StatefulDataLoader(batches, batch_size=None)),
    }


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo")
    from examples.dlrm.config import TrainConfig
    from examples.dlrm.data import make_sources
    from examples.dlrm.model import build_model
    from pipeline import TrainPipelineSparseDist

    config = TrainConfig(steps=args.steps, batch_size=args.batch_size)
    sharded = build_model(config, device=torch.device("cpu"), world_size=1, local_world_size=1)
    batches = list(make_sources(config, rank=0, world_size=1).train(0, 0))
    makers = _iterators(batches)
    names = list(makers)
    per_step: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds + 1):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            pipe = TrainPipelineSparseDist(sharded.model, sharded.optimizer, torch.device("cpu"))
            it = makers[name]()
            started = time.process_time()
            for _ in range(args.steps):
                pipe.progress(it)
            if r:  # round 0 warms up
                per_step[name].append((time.process_time() - started) / args.steps)
    for name in names:
        ratios = [a / b for a, b in zip(per_step[name], per_step["plain"], strict=True)]
        cost = _state_dict_cost(makers[name]())
        of_minima = min(per_step[name]) / min(per_step["plain"])
        print(
            f"{name:<11} cpu/step median {1000 * statistics.median(per_step[name]):8.3f} ms, "
            f"min {1000 * min(per_step[name]):8.3f} ms   ratio to plain: median of {args.rounds} "
            f"{statistics.median(ratios):.4f}, of the minima {of_minima:.4f}"
            f"   state_dict() {cost:7.2f} us"
        )
    dist.destroy_process_group()
    return 0


def _state_dict_cost(it) -> float:
    next(it)
    state_dict = getattr(it, "state_dict", None)
    if state_dict is None:
        return 0.0
    return 1e6 * min(timeit.repeat(state_dict, number=200, repeat=5)) / 200


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--port", type=int, default=29577)
    return p


if __name__ == "__main__":
    sys.exit(main())
