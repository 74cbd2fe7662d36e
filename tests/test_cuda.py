"""On a CUDA device: every pipeline class gives its plain reference's outputs and parameters bit for
bit, and the hand-offs keep nothing once the run is over.

Skipped without a GPU (CI has none); docs/gpu.md says how to run it on one. One rank per GPU over NCCL
(one GPU: one rank, whose input_dist all-to-alls are NCCL calls with itself), so the four streams
(memcpy, data_dist, prefetch, default) and their hand-offs are real. The cases and their references
are in `tests/cuda_cases.py` (shared with scripts/gpu/): the plain loop; for Eval the model's eval
outputs; for PT2 and CompAutograd the plain loop compiled the same way (aot_eager).

Two kernels: torchrec's fused kernel with the tables in HBM (every model kind and sharding for Base,
SparseDist and Prefetch; two kinds and shardings for the rest of the family), and its UVM-caching
kernel with a cache far smaller than the tables, where `prefetch()` really moves rows into the cache:
the Prefetch pipeline then fills batch i+1's rows while batch i computes, and the cache must keep
batch i's rows until its backward has written them. The hand-off under test is the keep-alive; two
cases run the previous one (`handoff="record-stream"`), which must give the same numbers.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.cuda_cases import CLASSES, HOST_ONLY, STEPS
from tests.harness import RankPool, pytest_timeout
from tests.models import KINDS, SHARDINGS

TIMEOUT = 180
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.timeout(pytest_timeout(TIMEOUT)),
]

PIPELINES = ("TrainPipelineBase", "TrainPipelineSparseDist", "PrefetchTrainPipelineSparseDist")
FAMILY = (
    "TrainPipelineFusedSparseDist",
    "TrainPipelineSemiSync",
    "EvalPipelineSparseDist",
    "StagedTrainPipeline",
)
COMPILED = ("TrainPipelinePT2", "TrainPipelineSparseDistCompAutograd")
LATER = tuple(name for name in CLASSES if name not in (*PIPELINES, *FAMILY, *COMPILED, *HOST_ONLY))
"""The classes that came with torchrec 1.9's modules, and the Staged variants: the DLRM, table-wise
(the stash and BwdOpt classes name a DLRM module as their site)."""
HBM_CASES = [
    *itertools.product(PIPELINES, KINDS, SHARDINGS),
    *itertools.product(FAMILY, ("dlrm", "nested"), ("table_wise", "column_wise")),
    *((name, "dlrm", "table_wise") for name in COMPILED),
    *((name, "dlrm", "table_wise") for name in LATER),
]
CACHE_CASES = [
    *itertools.product(PIPELINES, ("dlrm", "nested"), ("table_wise", "column_wise")),
    ("StagedTrainPipeline+prefetch", "dlrm", "table_wise"),  # its prefetch stage fills the cache
]
RECORD_STREAM_CASES = [("TrainPipelineSparseDist", "dlrm"), ("PrefetchTrainPipelineSparseDist", "nested")]


def _case(rank: int, world: int, name: str, kind: str, sharding: str, cached: bool, handoff: str) -> dict:
    from torchrec.distributed.types import CacheParams

    from tests.cuda_cases import run_case

    torch._dynamo.reset()
    # 3 tables of 40 rows share one cache of 32 slots (the kernel's smallest: one set of 32 ways),
    # and a batch touches up to 54 ids: rows are evicted and written back every step.
    cache = CacheParams(load_factor=0.2, prefetch_pipeline=True) if cached else None
    return run_case(name, kind, sharding, cache=cache, handoff=handoff)


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


def _check(r: dict, name: str) -> None:
    assert r["count"] == STEPS, f"{r['count']} outputs for {STEPS} batches"
    assert r["outputs_equal"], "per-step outputs differ from the reference"
    assert r["params_equal"], "final parameters differ from the reference"
    assert r["on_device"], "outputs are not on the GPU"
    assert r["kept_at_end"] == 0, f"{r['kept_at_end']} objects still kept after the run and wait_all()"
    if name not in ("TrainPipelineBase", "TrainPipelinePT2"):
        assert r["not_pipelined"] == [], f"not pipelined: {r['not_pipelined']}"


@pytest.fixture(scope="module")
def gpu():
    """One rank on the GPU (NCCL), for the module's scenarios one at a time."""
    ranks = RankPool(1, backend="nccl")
    yield ranks
    ranks.close()


@pytest.mark.parametrize(("name", "kind", "sharding"), HBM_CASES)
def test_hbm_kernel_bitwise_equal(gpu, name, kind, sharding):
    _check(gpu.run(_case, name, kind, sharding, False, "keep-alive", timeout=TIMEOUT)[0], name)


@pytest.mark.parametrize(("name", "kind", "sharding"), CACHE_CASES)
def test_uvm_cache_kernel_bitwise_equal(gpu, name, kind, sharding):
    _check(gpu.run(_case, name, kind, sharding, True, "keep-alive", timeout=TIMEOUT)[0], name)


@pytest.mark.parametrize(("name", "kind"), RECORD_STREAM_CASES)
def test_record_stream_handoff_gives_the_same_numbers(gpu, name, kind):
    r = gpu.run(_case, name, kind, "table_wise", False, "record-stream", timeout=TIMEOUT)[0]
    _check(r, name)
    assert r["kept_peak"] == 0, "the record_stream hand-off kept objects"


def test_semi_sync_equals_torchrecs_own_class(gpu):
    """SemiSync trains on stale embeddings by design (from `start_batch` on): it must be torchrec's
    class, bit for bit (before `start_batch` it is the plain loop: the family cases above)."""
    r = gpu.run(_semi_sync_against_torchrec, timeout=TIMEOUT)[0]
    assert r["counts"] == (STEPS, STEPS), r
    assert r["equal"], "not torchrec's TrainPipelineSemiSync, bit for bit"
