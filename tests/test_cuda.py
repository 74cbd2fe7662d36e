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

from tests.harness import RankPool, pytest_timeout
from tests.models import KINDS, SHARDINGS

TIMEOUT = 120
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none: docs/gpu.md)"),
    pytest.mark.timeout(pytest_timeout(TIMEOUT)),
]

PIPELINES = ("TrainPipelineBase", "TrainPipelineSparseDist", "PrefetchTrainPipelineSparseDist")
HBM_CASES = list(itertools.product(PIPELINES, KINDS, SHARDINGS))
CACHE_CASES = list(itertools.product(PIPELINES, ("dlrm", "nested"), ("table_wise", "column_wise")))
STEPS = 20


def _run(pipe_name: str, kind: str, sharding: str, cache) -> dict:
    import pipeline
    from pipeline.stages.copy import to_device
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


def _case(rank: int, world_size: int, pipe_name: str, kind: str, sharding: str, cached: bool) -> dict:
    from torchrec.distributed.types import CacheParams

    # 3 tables of 40 rows share one cache of 32 slots (the kernel's smallest: one set of 32 ways),
    # and a batch touches up to 54 ids: rows are evicted and written back every step.
    cache = CacheParams(load_factor=0.2, prefetch_pipeline=True) if cached else None
    return _run(pipe_name, kind, sharding, cache=cache)


def _semi_sync_against_torchrec(rank: int, world_size: int) -> dict:
    """Our TrainPipelineSemiSync and torchrec's, from the same model and batches, bit for bit."""
    from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSemiSync as Theirs

    import pipeline
    from tests import models

    device = torch.device("cuda", torch.cuda.current_device())
    runs = []
    for cls in (pipeline.TrainPipelineSemiSync, Theirs):
        model, opt = models.build("dlrm", "table_wise", device=device)
        pipe = cls(model, opt, device, start_batch=3)
        outputs = models.run_to_end(pipe, iter(models.batches("dlrm", STEPS, rank=0)))
        torch.cuda.synchronize()
        runs.append((len(outputs), outputs, model.state_dict()))
    (n_ours, *ours), (n_theirs, *theirs) = runs
    return {"counts": (n_ours, n_theirs), "equal": models.bitwise_equal(ours, theirs)}


def _check(r: dict, pipe_name: str) -> None:
    assert r["outputs_equal"], "per-step outputs differ from the plain loop"
    assert r["params_equal"], "final parameters differ from the plain loop"
    assert r["on_device"], "outputs are not on the GPU"
    assert r["stopped"], f"no StopIteration after {STEPS} outputs"
    if pipe_name != "TrainPipelineBase":
        assert r["not_pipelined"] == [], r


@pytest.fixture(scope="module")
def gpu():
    """One rank on the GPU (NCCL), for the module's scenarios one at a time."""
    ranks = RankPool(1, backend="nccl")
    yield ranks
    ranks.close()


@pytest.mark.parametrize(("pipe_name", "kind", "sharding"), HBM_CASES)
def test_hbm_kernel_bitwise_equal(gpu, pipe_name, kind, sharding):
    _check(gpu.run(_case, pipe_name, kind, sharding, False, timeout=TIMEOUT)[0], pipe_name)


@pytest.mark.parametrize(("pipe_name", "kind", "sharding"), CACHE_CASES)
def test_uvm_cache_kernel_bitwise_equal(gpu, pipe_name, kind, sharding):
    _check(gpu.run(_case, pipe_name, kind, sharding, True, timeout=TIMEOUT)[0], pipe_name)


def test_fused_lookup_pipeline_bitwise_equal(gpu):
    """The Fused pipeline (lookup on the data_dist stream) equals the plain loop."""
    name = "TrainPipelineFusedSparseDist"
    _check(gpu.run(_case, name, "dlrm", "table_wise", False, timeout=TIMEOUT)[0], name)


def test_semi_sync_equals_torchrecs_own_class(gpu):
    """SemiSync trains on stale embeddings by design: it must be torchrec's class, bit for bit (on
    CPU, tests/test_family.py compares it with a reference derived from torchrec's semantics)."""
    r = gpu.run(_semi_sync_against_torchrec, timeout=TIMEOUT)[0]
    assert r["counts"] == (STEPS, STEPS), r
    assert r["equal"], "not torchrec's TrainPipelineSemiSync, bit for bit"
