"""TrainPipelineSparseDistBwdOpt on 2 gloo ranks: the optimizer step inside backward, at the
output all-to-all of a sharded module, with the plain loop's numbers bit for bit.

What ours promises (pipeline/pipelines/backward_opt.py): the step runs at the injection site, or
after it as soon as every gradient it applies is final; where DDP reduces the dense gradients
(DistributedModelParallel's default), that is the end of backward. Each scenario checks the
outputs and parameters against the plain loop, that the step ran inside backward (the autograd
engine's graph task is live), and where. The negative twin is torchrec's own class, which steps at
the site on partial, unreduced gradients: it runs on CPU and must differ from the plain loop.
"""

from __future__ import annotations

import pytest

from tests.harness import pytest_timeout

STEPS = 6
TIMEOUT = 150
pytestmark = [pytest.mark.timeout(pytest_timeout(TIMEOUT)), pytest.mark.slow]

SITES = {
    "dlrm": "model.sparse_arch.embedding_bag_collection",
    "nested": "user_ebc",
    "split": "a",  # tests/user_models.py: tables table-wise and column-wise in one collection
}


def _build(kind: str, sharding: str, ddp: bool):
    from tests import models, user_models

    if kind in user_models.PATTERNS:
        return user_models.build(kind)
    return models.build(kind, sharding, ddp=ddp)


def _batches(kind: str, rank: int) -> list:
    from tests import models, user_models

    if kind in user_models.PATTERNS:
        return user_models.batches(STEPS, rank)
    return models.batches(kind, STEPS, rank)


def _sharding_type(sharding: str):
    from torchrec.distributed.types import ShardingType

    return ShardingType(sharding)


def _case(rank: int, world_size: int, kind: str, sharding: str, ddp: bool) -> dict:
    import torch

    import pipeline
    from tests import models

    ref, ref_opt = _build(kind, sharding, ddp)
    expected = models.plain_loop(ref, ref_opt, _batches(kind, rank))
    model, opt = _build(kind, sharding, ddp)
    inside: list[bool] = []

    class Recording(pipeline.TrainPipelineSparseDistBwdOpt):
        def _optimizer_step(self) -> None:
            inside.append(torch._C._current_graph_task_id() != -1)  # a backward is running
            super()._optimizer_step()

    pipe = Recording(model, opt, torch.device("cpu"), SITES[kind], _sharding_type(sharding))
    outputs, stopped = models.outputs_then_stop(pipe, iter(_batches(kind, rank)), STEPS)
    return {
        "outputs": models.bitwise_equal(expected, outputs),
        "params": models.bitwise_equal(ref.state_dict(), model.state_dict()),
        "stopped": stopped,
        "inside": inside,
        "placement": pipe.step_placement.name,
        "notes": list(pipe.rewrite_report.notes),
        "is_sparse_dist": isinstance(pipe, pipeline.TrainPipelineSparseDist),
    }


CASES = [
    # DDP reduces the dense gradients: the step runs at the end of backward, after the all-reduce
    ("dlrm", "table_wise", True, "AT_END_OF_BACKWARD"),
    ("dlrm", "column_wise", True, "AT_END_OF_BACKWARD"),
    ("split", "table_wise", True, "AT_END_OF_BACKWARD"),
    ("split", "column_wise", True, "AT_END_OF_BACKWARD"),
    # no DDP: DLRM's dense arch is differentiated after the site, so the step waits for it
    ("dlrm", "table_wise", False, "AT_LAST_GRADIENT"),
    # no DDP, every dense layer runs after the collections: the step runs at the site
    ("nested", "column_wise", False, "AT_SITE"),
]


@pytest.mark.parametrize(("kind", "sharding", "ddp", "placement"), CASES)
def test_bwd_opt_steps_inside_backward_with_the_plain_loops_numbers(pool, kind, sharding, ddp, placement):
    for rank, r in enumerate(pool.run(_case, kind, sharding, ddp, timeout=TIMEOUT)):
        where = f"BwdOpt on {kind} ({sharding}, {'DDP' if ddp else 'no DDP'}), rank {rank}"
        assert r["stopped"], f"{where}: no StopIteration after {STEPS} outputs"
        assert r["outputs"], f"{where}: per-step outputs differ from the plain loop"
        assert r["params"], f"{where}: final parameters differ from the plain loop"
        assert r["inside"] == [True] * STEPS, f"{where}: the step ran outside backward: {r['inside']}"
        assert r["placement"] == placement, f"{where}: the step ran {r['placement']}, not {placement}"
        if placement != "AT_SITE":
            assert any("optimizer step ran" in n for n in r["notes"]), f"{where}: no note: {r['notes']}"
        assert r["is_sparse_dist"], f"{where}: not an instance of TrainPipelineSparseDist"


def test_bwd_opt_on_one_rank_steps_after_backward_with_the_plain_loops_numbers(one_rank):
    """On one rank the output all-to-all is no collective: backward never reaches the site, and
    the step runs after backward (noted in the report), with the plain loop's numbers."""
    r = one_rank.run(_case, "dlrm", "table_wise", True, timeout=TIMEOUT)[0]
    assert r["stopped"], f"no StopIteration after {STEPS} outputs: {r}"
    assert r["outputs"] and r["params"], f"outputs or parameters differ from the plain loop: {r}"
    assert r["placement"] == "AFTER_BACKWARD", f"the step ran {r['placement']}"
    assert r["inside"] == [False] * STEPS, f"a step ran inside backward: {r['inside']}"
    assert any("after backward" in n for n in r["notes"]), f"no note: {r['notes']}"


def _torchrec_case(rank: int, world_size: int) -> dict:
    """torchrec's own class, the negative twin: it steps at the site whatever the gradients are."""
    import torch
    from torchrec.distributed.train_pipeline.experimental_pipelines import TrainPipelineSparseDistBwdOpt

    from tests import models

    ref, ref_opt = models.build("dlrm", "table_wise")
    expected = models.plain_loop(ref, ref_opt, _batches("dlrm", rank))
    model, opt = models.build("dlrm", "table_wise")
    pipe = TrainPipelineSparseDistBwdOpt(model, opt, torch.device("cpu"), SITES["dlrm"])
    try:
        outputs = models.run_to_end(pipe, iter(_batches("dlrm", rank)))
    except Exception as e:  # where torchrec's class does not run here
        return {"error": f"{type(e).__name__}: {e}"}
    return {
        "error": None,
        "count": len(outputs),
        "equal": models.bitwise_equal(expected, outputs)
        and models.bitwise_equal(ref.state_dict(), model.state_dict()),
    }


def test_torchrecs_bwd_opt_is_not_the_plain_loop(pool):
    for rank, r in enumerate(pool.run(_torchrec_case, timeout=TIMEOUT)):
        if r["error"] is not None:
            pytest.skip(f"torchrec's TrainPipelineSparseDistBwdOpt does not run here: {r['error']}")
        assert r["count"] == STEPS, f"rank {rank}: torchrec's class gave {r['count']} outputs"
        assert not r["equal"], f"rank {rank}: torchrec's class now equals the plain loop: ours may follow it"


def _bad_site(rank: int, world_size: int) -> str | None:
    import torch

    import pipeline
    from tests import models

    model, opt = models.build("dlrm", "table_wise")
    try:
        pipeline.TrainPipelineSparseDistBwdOpt(model, opt, torch.device("cpu"), "model.no_such_module")
    except ValueError as e:
        return str(e)
    return None


def test_bwd_opt_refuses_a_site_that_is_not_a_module(pool):
    for rank, message in enumerate(pool.run(_bad_site, timeout=TIMEOUT)):
        assert message and "model.no_such_module" in message, f"rank {rank}: {message}"
