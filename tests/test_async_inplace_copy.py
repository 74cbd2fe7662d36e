"""`async_inplace_copy`, the keyword torchrec 1.9 added to four classes, on 2 gloo ranks.

torchrec's dispatches the in-place host-to-device copy from a worker thread on cuda/mtia only; on
any other device it logs a warning and turns itself off. Either way the batches, their order and the
numbers are the synchronous pipeline's. Ours accepts the keyword and changes nothing: with it on
(and `enable_inplace_copy_batch`, the path it applies to) each class gives the plain loop's outputs
and parameters bit for bit, with a negative twin (one optimizer step less) that must differ; where
the installed torchrec has the keyword and its class runs on CPU, ours equals torchrec's class
given the same keywords.
"""

from __future__ import annotations

import pytest

from tests.harness import pytest_timeout

CLASSES = (
    "TrainPipelineSparseDist",
    "PrefetchTrainPipelineSparseDist",
    "TrainPipelineSparseDistLite",
    "TrainEvalHybridPipelineBase",
)
# torchrec's Prefetch refuses every batch on CPU (its prefetch stream is CUDA only)
THEIRS_ON_CPU = {
    "TrainPipelineSparseDist": "train_pipelines",
    "TrainPipelineSparseDistLite": "train_pipelines",
    "TrainEvalHybridPipelineBase": "experimental_pipelines",
}
OPTIONS = {"async_inplace_copy": True, "enable_inplace_copy_batch": True}
TIMEOUT = 150
pytestmark = [pytest.mark.timeout(pytest_timeout(TIMEOUT)), pytest.mark.slow]


def _theirs(name: str):
    """torchrec's class `name` where it runs on CPU and takes `async_inplace_copy`, else None."""
    import importlib
    import inspect

    if name not in THEIRS_ON_CPU:
        return None
    module = importlib.import_module(f"torchrec.distributed.train_pipeline.{THEIRS_ON_CPU[name]}")
    cls = getattr(module, name, None)
    if cls is None or "async_inplace_copy" not in inspect.signature(cls).parameters:
        return None
    return cls


def _case(rank: int, world_size: int, name: str) -> dict:
    import torch

    from tests import models
    from tests.test_family import _train_case

    theirs = _theirs(name)

    def torchrec_loop(model, opt, data):
        return models.run_to_end(theirs(model, opt, torch.device("cpu"), **OPTIONS), iter(data))

    compare = {} if theirs is None else {"torchrec": torchrec_loop}
    result = _train_case(rank, name, "dlrm", "table_wise", models.plain_loop, compare=compare, **OPTIONS)
    result["compared_with_torchrec"] = theirs is not None
    return result


@pytest.mark.parametrize("name", CLASSES)
def test_the_plain_loops_numbers_with_it_on(pool, name):
    from tests.test_family import _check_trained

    for rank, r in enumerate(pool.run(_case, name, timeout=TIMEOUT)):
        _check_trained(r, rank, f"the plain loop ({name}, async_inplace_copy=True)")
        if r["compared_with_torchrec"]:
            assert r["equals_torchrec"], f"rank {rank}: {name} differs from torchrec's with the same keywords"


def test_torchrecs_class_is_compared_where_it_has_the_keyword():
    """The torchrec comparison is not silently skipped on the stack that has the keyword."""
    import inspect

    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    if "async_inplace_copy" not in inspect.signature(TrainPipelineSparseDist).parameters:
        pytest.skip("the installed torchrec (1.8) has no async_inplace_copy: ours is compared with the loop")
    missing = [n for n in THEIRS_ON_CPU if _theirs(n) is None]
    assert not missing, f"torchrec's {missing} not found with async_inplace_copy: nothing compared"
