"""On a CUDA device: every pipeline gives the plain loop's outputs and parameters bit for bit.

Skipped without a GPU (CI has none); docs/gpu.md records the runs on the GPU machine. One rank per
GPU over NCCL (one GPU: one rank, whose input_dist all-to-alls are NCCL calls with itself), so the
four streams (memcpy, data_dist, prefetch, default) and their hand-offs are real.

Two kernels: torchrec's fused kernel with the tables in HBM (every model kind and sharding), and its
UVM-caching kernel with a cache far smaller than the tables, where `prefetch()` really moves rows into
the cache: the Prefetch pipeline then fills batch i+1's rows while batch i computes, and the cache
must keep batch i's rows until its backward has written them.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.harness import run_ranks
from tests.models import KINDS, SHARDINGS

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none: docs/gpu.md)"),
    pytest.mark.timeout(900),  # the module's fixtures build 66 sharded models in the first tests
]

PIPELINES = ("TrainPipelineBase", "TrainPipelineSparseDist", "PrefetchTrainPipelineSparseDist")
FAMILY = ("TrainPipelineFusedSparseDist", "TrainPipelineSemiSync")
HBM_CASES = list(itertools.product(PIPELINES, KINDS, SHARDINGS))
CACHE_CASES = list(itertools.product(PIPELINES, ("dlrm", "nested"), ("table_wise", "column_wise")))
STEPS = 20


def _run(pipe_name: str, kind: str, sharding: str, cache) -> dict:
    import pipeline
    from pipeline.batch import to_device
    from tests import models

    device = torch.device("cuda", torch.cuda.current_device())
    data = models.batches(kind, STEPS, rank=0)
    ref_model, ref_opt = models.build(kind, sharding, device=device, cache=cache)
    expected = models.plain_loop(ref_model, ref_opt, [to_device(b, device, False) for b in data])
    model, opt = models.build(kind, sharding, device=device, cache=cache)
    if pipe_name.startswith("torchrec."):  # torchrec's own, for scripts/gpu/csan.py
        from torchrec.distributed import train_pipeline

        pipe = getattr(train_pipeline, pipe_name.removeprefix("torchrec."))(model, opt, device)
    else:
        pipe = getattr(pipeline, pipe_name)(model, opt, device)
    outputs, stopped = models.outputs_then_stop(pipe, iter(models.batches(kind, STEPS, rank=0)), STEPS)
    torch.cuda.synchronize()
    report = getattr(pipe, "rewrite_report", None)
    return {
        "outputs_equal": models.bitwise_equal(expected, outputs),
        "params_equal": models.bitwise_equal(ref_model.state_dict(), model.state_dict()),
        "on_device": all(o.device.type == "cuda" for o in models.flat_tensors(outputs)),
        "stopped": stopped,
        "not_pipelined": None if report is None else [m.fqn for m in report.not_pipelined],
    }


def _hbm_cases(rank: int, world_size: int) -> dict:
    return {case: _run(*case, cache=None) for case in HBM_CASES}


def _cache_cases(rank: int, world_size: int) -> dict:
    from torchrec.distributed.types import CacheParams

    # 3 tables of 40 rows share one cache of 32 slots (the kernel's smallest: one set of 32 ways),
    # and a batch touches up to 54 ids: rows are evicted and written back every step.
    cache = CacheParams(load_factor=0.2, prefetch_pipeline=True)
    return {case: _run(*case, cache=cache) for case in CACHE_CASES}


def _family_cases(rank: int, world_size: int) -> dict:
    return {name: _run(name, "dlrm", "table_wise", cache=None) for name in FAMILY}


def _check(r: dict, pipe_name: str) -> None:
    assert r["outputs_equal"], "per-step outputs differ from the plain loop"
    assert r["params_equal"], "final parameters differ from the plain loop"
    assert r["on_device"], "outputs are not on the GPU"
    assert r["stopped"], f"no StopIteration after {STEPS} outputs"
    if pipe_name != "TrainPipelineBase":
        assert r["not_pipelined"] == [], r


@pytest.fixture(scope="module")
def hbm() -> dict:
    return run_ranks(_hbm_cases, 1, timeout=900, backend="nccl")[0]


@pytest.fixture(scope="module")
def cached() -> dict:
    return run_ranks(_cache_cases, 1, timeout=600, backend="nccl")[0]


@pytest.mark.parametrize(("pipe_name", "kind", "sharding"), HBM_CASES)
def test_hbm_kernel_bitwise_equal(hbm, pipe_name, kind, sharding):
    _check(hbm[(pipe_name, kind, sharding)], pipe_name)


@pytest.mark.parametrize(("pipe_name", "kind", "sharding"), CACHE_CASES)
def test_uvm_cache_kernel_bitwise_equal(cached, pipe_name, kind, sharding):
    _check(cached[(pipe_name, kind, sharding)], pipe_name)


def test_family_fused_lookup_bitwise_equal():
    """The Fused pipeline (lookup on the data_dist stream) equals the plain loop; SemiSync trains on
    stale embeddings by design, so it only has to run to the end."""
    r = run_ranks(_family_cases, 1, timeout=600, backend="nccl")[0]
    _check(r["TrainPipelineFusedSparseDist"], "TrainPipelineFusedSparseDist")
    assert r["TrainPipelineSemiSync"]["stopped"] and r["TrainPipelineSemiSync"]["on_device"]
