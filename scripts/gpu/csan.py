"""Every pipeline class under PyTorch's CUDA sanitizer: an access on one stream to memory another
stream wrote (or a free racing a use), with no event between them, raises. One NCCL rank runs every
case in turn and prints one line per case.

    PYTHONPATH=.:$PYTHONPATH python scripts/gpu/csan.py [--steps 8] [--classes NAME ...]

Each case trains `tests/models`' "dlrm" or "nested" table-wise next to its reference
(`tests/cuda_cases.py`, as `tests/test_cuda.py` does) and prints the outputs' and parameters'
equality, or the sanitizer's last line (its report on stderr names both accesses; it stops the case
at the first). torchrec's own SparseDist and Prefetch pipelines run too, for comparison. The
sanitizer is a TorchDispatchMode: torch.compile does not trace under it, so PT2 and CompAutograd
run their forward (PT2) or backward (CompAutograd) eager here.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.getcwd())

from tests.cuda_cases import CLASSES, HOST_ONLY, OPTIONS
from tests.harness import run_ranks

KINDS = (("dlrm", False), ("nested", False), ("dlrm", True))
"""(model kind, UVM-caching tables): HBM tables, and tables behind a cache `prefetch()` fills."""
COMPARED = ("torchrec.TrainPipelineSparseDist", "torchrec.PrefetchTrainPipelineSparseDist")
DLRM_ONLY = ("TrainPipelinePT2", "TrainPipelineSparseDistCompAutograd", *OPTIONS, *COMPARED)
CACHED_TOO = ("torchrec.PrefetchTrainPipelineSparseDist",)
"""DLRM-only classes also run with the cache: torchrec's Prefetch, against ours."""
NO_CACHE = ("StagedTrainPipeline+lookup",)
"""Its reference swaps the tables through the state_dict, which a UVM cache's is not."""


def cases(classes: list[str], device: str = "cuda") -> list[tuple[str, str, bool]]:
    """(class, kind, cached) for every case to run: with the cache on CUDA only, and the classes
    whose sharded modules live on the host on the CPU only."""
    return [
        (name, kind, cached)
        for name in classes
        for kind, cached in KINDS
        if not (name in DLRM_ONLY and (kind != "dlrm" or (cached and name not in CACHED_TOO)))
        and not (cached and (device != "cuda" or name in NO_CACHE))
        and not (device == "cuda" and name in HOST_ONLY)
    ]


def _all(rank: int, world_size: int, todo: list, steps: int, device: str) -> list[str]:
    import torch

    lines = []
    if device == "cuda":
        import torch.cuda._sanitizer as csan

        csan.enable_cuda_sanitizer()
    from torchrec.distributed.types import CacheParams

    from tests.cuda_cases import run_case

    for name, kind, cached in todo:
        tag = f"{name} {kind} {'uvm-cache' if cached else 'hbm'}"
        cache = CacheParams(load_factor=0.2, prefetch_pipeline=True) if cached else None
        torch._dynamo.reset()
        try:
            r = run_case(name, kind, "table_wise", cache=cache, steps=steps, device=torch.device(device))
            line = f"CSAN clean   {tag}: outputs {r['outputs_equal']}, params {r['params_equal']}"
        except Exception as e:  # the sanitizer's CUDASanitizerErrors, or the case's own failure
            last = [ln for ln in str(e).splitlines() if ln.strip()]
            what = "report " if type(e).__name__ == "CUDASanitizerErrors" else "failed "
            line = f"CSAN {what} {tag}: {type(e).__name__}: {last[-1] if last else e}"
        print(line, flush=True)
        lines.append(line)
    return lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--classes", nargs="+", default=[*CLASSES, *COMPARED], help="default: every class")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run")
    parser.add_argument("--timeout", type=float, default=330)
    args = parser.parse_args(argv)
    unknown = [c for c in args.classes if c not in (*CLASSES, *COMPARED)]
    if unknown:
        parser.error(f"unknown classes {unknown}; known: {[*CLASSES, *COMPARED]}")
    backend = "nccl" if args.device == "cuda" else "gloo"
    todo = cases(args.classes, args.device)
    run_ranks(_all, 1, timeout=args.timeout, backend=backend, args=(todo, args.steps, args.device))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
