"""The pipelines under PyTorch's CUDA sanitizer: an access on one stream to a tensor another stream
wrote without an event between them raises. One rank (NCCL) per case; prints one line per case.

    PYTHONPATH=.:$PYTHONPATH python scripts/gpu/csan.py

Each case trains `tests/models` "dlrm" or "nested" table-wise for 20 steps next to the plain loop (as
`tests/test_cuda.py` does) and reports the outputs' and parameters' equality, or that the sanitizer
reported (its report, on stderr, names both accesses; it stops at the first). torchrec's own Prefetch
pipeline runs too, for comparison.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.getcwd())

from tests.harness import run_ranks

PIPELINES = (
    "TrainPipelineBase",
    "TrainPipelineSparseDist",
    "PrefetchTrainPipelineSparseDist",
    "TrainPipelineFusedSparseDist",
    "torchrec.PrefetchTrainPipelineSparseDist",
)
CASES = (("dlrm", False), ("nested", False), ("dlrm", True))


def _case(rank: int, world_size: int, pipe_name: str, kind: str, cached: bool) -> dict:
    import torch.cuda._sanitizer as csan

    csan.enable_cuda_sanitizer()
    from torchrec.distributed.types import CacheParams

    from tests.test_cuda import _run

    cache = CacheParams(load_factor=0.2, prefetch_pipeline=True) if cached else None
    return _run(pipe_name, kind, "table_wise", cache)


def _last_line(error: str) -> str:
    lines = [ln for ln in error.splitlines() if ln.strip()]
    return lines[-1] if lines else error


def main() -> None:
    for pipe_name in PIPELINES:
        for kind, cached in CASES:
            if pipe_name.startswith("torchrec.") and kind != "dlrm":
                continue
            tag = f"{pipe_name} {kind} {'uvm-cache' if cached else 'hbm'}"
            try:
                r = run_ranks(_case, 1, timeout=200, backend="nccl", args=(pipe_name, kind, cached))[0]
                print(f"CSAN clean   {tag}: {r}", flush=True)
            except Exception as e:  # a rank's CUDASanitizerErrors arrives as RankError
                # the sanitizer prints its report (both accesses, ops and stacks) on the rank's stderr
                print(f"CSAN report  {tag}: {_last_line(str(e))}", flush=True)


if __name__ == "__main__":
    main()
