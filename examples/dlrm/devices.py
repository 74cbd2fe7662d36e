"""Which device each rank of the DLRM example trains on, and how many ranks `make demo` starts.

`--device auto` gives a rank `cuda:LOCAL_RANK` only where every local rank has a GPU of its own;
with fewer GPUs than local ranks (2 ranks on a machine with one GPU) every rank trains on the CPU
with gloo, so that no rank asks for a GPU that is not there. `--device cuda` with fewer GPUs than
local ranks is an error that says how many ranks fit.

`make demo` asks `python -m examples.dlrm.devices` for its layout: one rank per GPU where there are
two or more (NCCL), else 2 CPU ranks (gloo); it prints `NPROC DEVICE` on stdout and one line on
stderr saying what runs and why. `DEMO_NPROC` and `DEMO_DEVICE` (make variables) override it.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from examples.dlrm.config import InputError

__all__ = ["DemoLayout", "demo_layout", "gpu_count", "main", "rank_device"]

DEMO_RANKS = 2
"""Ranks of the demo where it runs on the CPU: the smallest world with an all-to-all to hide."""


def gpu_count() -> int:
    """The GPUs torch can use here (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def rank_device(choice: str, local_rank: int, local_world_size: int) -> str:
    """The device of one rank: `cuda:<local_rank>` or `cpu`.

    Args:
        choice: `--device`: "auto", "cpu" or "cuda".
        local_rank: the rank's index on its node (torchrun's LOCAL_RANK).
        local_world_size: the ranks on its node (torchrun's LOCAL_WORLD_SIZE).

    Raises:
        InputError: "cuda" where this node has fewer GPUs than local ranks.
    """
    if choice == "cpu":
        return "cpu"
    gpus = gpu_count()
    if gpus >= local_world_size:
        return f"cuda:{local_rank}"
    if choice == "cuda":
        raise InputError(
            f"--device cuda: {local_world_size} local rank(s) and {gpus} GPU(s) here; start at most "
            f"{gpus} rank(s) per node (--nproc_per_node={gpus})"
            if gpus
            else "--device cuda: no CUDA device is usable here (torch.cuda.is_available() is False); "
            "use --device cpu, or auto to take a GPU when there is one"
        )
    return "cpu"


@dataclass(frozen=True, slots=True)
class DemoLayout:
    """What `make demo` starts."""

    nproc: int
    """Local ranks (torchrun's --nproc_per_node)."""
    device: str
    """`--device` of every rank: "cuda" or "cpu"."""
    message: str
    """One line saying what runs, and why."""


def demo_layout(nproc: int | None = None, device: str = "auto") -> DemoLayout:
    """The demo's ranks and device: one rank per GPU where there are two or more, else
    `DEMO_RANKS` CPU ranks. `nproc` and `device` ("auto", "cpu", "cuda") override the choice.

    Raises:
        InputError: `device="cuda"` with fewer GPUs than ranks (or none).
    """
    gpus = gpu_count()
    if device == "cpu":
        ranks = nproc or DEMO_RANKS
        return DemoLayout(ranks, "cpu", f"make demo: {ranks} CPU rank(s) (gloo), as asked")
    if device == "cuda":
        ranks = nproc or gpus
        rank_device("cuda", 0, max(ranks, 1))  # raises where the GPUs do not suffice
        return DemoLayout(ranks, "cuda", f"make demo: {ranks} rank(s), one GPU each (NCCL), as asked")
    ranks = nproc or (gpus if gpus >= 2 else DEMO_RANKS)
    if gpus >= ranks:
        return DemoLayout(ranks, "cuda", f"make demo: {ranks} rank(s), one GPU each (NCCL)")
    if gpus == 0:
        why = "no GPU here"
    elif gpus == 1 and nproc is None:
        why = "one GPU here and the demo compares 2 ranks (DEMO_NPROC=1 runs one rank on the GPU)"
    else:
        why = f"{gpus} GPU(s) for {ranks} ranks"
    return DemoLayout(ranks, "cpu", f"make demo: {ranks} CPU ranks (gloo): {why}")


def main(argv: list[str] | None = None) -> int:
    """Print `NPROC DEVICE` for `make demo`, and its one-line message on stderr; 2 on bad input."""
    parser = argparse.ArgumentParser(prog="python -m examples.dlrm.devices", description=__doc__)
    parser.add_argument("--nproc", default="", help="ranks to start (empty: one per GPU, or 2 on CPU)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    args = parser.parse_args(argv)
    try:
        if args.nproc and (not args.nproc.isdigit() or int(args.nproc) < 1):
            raise InputError(f"DEMO_NPROC={args.nproc!r}: give a number of ranks, 1 or more")
        layout = demo_layout(int(args.nproc) if args.nproc else None, args.device)
    except InputError as e:
        print(f"make demo: error: {e}", file=sys.stderr)
        return 2
    print(layout.message, file=sys.stderr)
    print(layout.nproc, layout.device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
