"""Models written as users write them (tests/user_models.py: a KJT split, keys selected, a KJT built
from plain tensors, one collection called twice, a forward the trace cannot follow) are fully
pipelined by every class that runs input_dist ahead, bit for bit, on 2 gloo ranks with table-wise
and column-wise tables in one model and distinct batches per rank.

Each case asserts: the per-step outputs and final parameters equal the reference (the plain loop;
SemiSync: its stale-embedding reference; Eval: the model's own outputs, nothing stepped), one output
per batch then StopIteration, and the rewrite report pipelines every call site of every module,
found the way the pattern allows (traced, or recorded where forward is untraceable).
"""

from __future__ import annotations

import functools
import itertools

import pytest

from tests.harness import pytest_timeout
from tests.user_models import PATTERNS, SITES

STAGED = "PrefetchTrainPipelineSparseDist+stage"
"""The Prefetch pipeline made to run its prefetch stage (fused kernels have no prefetch work, which
makes it run SparseDist's step): the stage's per-call-site hand-offs are tested too."""
CLASSES = (
    "TrainPipelineSparseDist",
    "PrefetchTrainPipelineSparseDist",
    STAGED,
    "TrainPipelineFusedSparseDist",
    "TrainPipelineSemiSync",
    "EvalPipelineSparseDist",
    "StagedTrainPipeline",
)
STEPS = 8
TIMEOUT = 120
pytestmark = [pytest.mark.timeout(pytest_timeout(TIMEOUT)), pytest.mark.slow]


def _reference(name: str):
    from tests import models
    from tests.test_family import semi_sync_reference

    if name == "TrainPipelineSemiSync":
        return functools.partial(semi_sync_reference, start_batch=2)
    if name == "EvalPipelineSparseDist":
        return _forward_only
    return models.plain_loop


def _forward_only(model, optimizer, data: list) -> list:
    import torch

    with torch.no_grad():
        return [model(batch)[1] for batch in data]


def _staged_run(model, opt, data: list) -> tuple[list, object]:
    """StagedTrainPipeline with SparseDataDistUtil's stage; the caller's loop trains."""
    import torch

    import pipeline
    from tests.models import run_to_end  # noqa: F401  (same loop shape as the others)

    sdd = pipeline.SparseDataDistUtil(model, None)
    pipe = pipeline.StagedTrainPipeline([sdd.start_sparse_data_dist_stage()])
    outputs, it = [], iter(data)
    while (batch := pipe.progress(it)) is not None:
        opt.zero_grad()
        loss, out = model(batch)
        torch.sum(loss).backward()
        opt.step()
        outputs.append(out)
    return outputs, sdd


def _case(rank: int, world_size: int, name: str, pattern: str) -> dict:
    if name != STAGED:
        return _run_case(rank, name, pattern)
    from unittest import mock

    with mock.patch("pipeline.pipelines.prefetch.prefetch_does_work", lambda module: True):
        result = _run_case(rank, "PrefetchTrainPipelineSparseDist", pattern)
    assert result["mode"] == "prefetch", result["mode"]
    return result


def _run_case(rank: int, name: str, pattern: str) -> dict:
    import torch

    import pipeline
    from tests import models, user_models

    ref, ref_opt = user_models.build(pattern)
    expected = _reference(name)(ref, ref_opt, user_models.batches(STEPS, rank))
    model, opt = user_models.build(pattern)
    data = user_models.batches(STEPS, rank)
    if name == "StagedTrainPipeline":
        outputs, holder = _staged_run(model, opt, data)
        stopped = True
    else:
        extra = {"start_batch": 2} if name == "TrainPipelineSemiSync" else {}
        holder = getattr(pipeline, name)(model, opt, torch.device("cpu"), **extra)
        outputs, stopped = models.outputs_then_stop(holder, iter(data), STEPS)
    report = holder.rewrite_report
    return {
        "outputs": models.bitwise_equal(expected, outputs),
        "params": models.bitwise_equal(ref.state_dict(), model.state_dict()),
        "count": len(outputs),
        "stopped": stopped,
        "sites": [(s.key, m.pipelined, m.method) for m in report.modules for s in m.sites],
        "modules": len(report.modules),
        "mode": getattr(holder, "prefetch_mode", None),
        "report": str(report),
    }


@pytest.mark.parametrize(("name", "pattern"), list(itertools.product(CLASSES, PATTERNS)))
def test_user_models_are_pipelined_bit_for_bit(pool, name, pattern):
    for rank, r in enumerate(pool.run(_case, name, pattern, timeout=TIMEOUT)):
        where = f"{name} on the {pattern!r} model, rank {rank}"
        assert r["count"] == STEPS and r["stopped"], f"{where}: {r['count']} outputs, stopped={r['stopped']}"
        assert r["outputs"], f"{where}: per-step outputs differ from the reference"
        assert r["params"], f"{where}: final parameters differ from the reference"
        pipelined = [key for key, ok, _ in r["sites"] if ok]
        assert len(pipelined) == SITES[pattern] == len(r["sites"]), f"{where}: report\n{r['report']}"
        assert r["modules"] == len({key.split("@")[0] for key in pipelined}), f"{where}: {r['report']}"
        methods = {method for _, _, method in r["sites"]}
        expected = {"recorded"} if pattern == "recorded" else {"traced"}
        assert methods == expected, f"{where}: found by {methods}, not {expected}\n{r['report']}"
        if name == "PrefetchTrainPipelineSparseDist":  # its note comes before a recorded forward ends
            assert "TrainPipelineSparseDist's step" in r["report"], f"{where}: note lost\n{r['report']}"


def _explicit(rank: int, world_size: int, wrong: bool) -> dict:
    import torch

    import pipeline
    from tests import models, user_models

    def inputs(batch):  # forward's three calls: a on the split, h on the history, h on the built KJT
        from torchrec import KeyedJaggedTensor

        built = KeyedJaggedTensor.from_lengths_sync(keys=["hf0"], values=batch.ids, lengths=batch.lengths)
        history = built if wrong else batch.history
        return {"a": [batch.sparse.split([2, 1])[0]], "h": [history, built]}

    ref, ref_opt = user_models.build("recorded")
    expected = models.plain_loop(ref, ref_opt, user_models.batches(STEPS, rank))
    model, opt = user_models.build("recorded")
    paths = {fqn: (lambda b, fqn=fqn: inputs(b)[fqn]) for fqn in ("a", "h")}
    pipe = pipeline.TrainPipelineSparseDist(
        model, opt, torch.device("cpu"), rewrite=pipeline.RewriteOptions(arg_paths=paths)
    )
    try:
        outputs = models.run_to_end(pipe, iter(user_models.batches(STEPS, rank)))
    except Exception as e:  # the mismatch is reported on the first batch
        return {"error": f"{type(e).__name__}: {e}"}
    methods = {m.method for m in pipe.rewrite_report.modules}
    return {"error": None, "equal": models.bitwise_equal(expected, outputs), "methods": methods}


@pytest.mark.parametrize("wrong", [False, True])
def test_explicit_inputs_per_call_site_are_checked_against_the_first_forward(pool, wrong):
    for rank, r in enumerate(pool.run(_explicit, wrong, timeout=TIMEOUT)):
        if wrong:  # the function gives h's first call the built KJT, forward passes the history
            assert r["error"] and "PathError" in r["error"] and "'h'" in r["error"], f"rank {rank}: {r}"
        else:
            assert r["error"] is None, f"rank {rank}: {r['error']}"
            assert r["equal"], f"rank {rank}: outputs differ from the plain loop"
            assert r["methods"] == {"explicit"}, f"rank {rank}: {r['methods']}"


def _count_changes(rank: int, world_size: int) -> str | None:
    import torch

    import pipeline
    from tests import models, user_models

    model, opt = user_models.build("shared")
    data = user_models.batches(6, rank)
    inner = model.module
    original = type(inner)._embeddings

    def fewer_calls_on_batch_3(self, batch):
        if batch is not data[3]:
            return original(self, batch)
        first, _ = batch.sparse.split([2, 1])
        history = self.h(batch.history)  # h called once, not twice
        return [self.a(first), history, history]

    type(inner)._embeddings = fewer_calls_on_batch_3
    try:
        models.run_to_end(pipeline.TrainPipelineSparseDist(model, opt, torch.device("cpu")), iter(data))
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        type(inner)._embeddings = original
    return None


def test_a_call_count_that_changes_between_batches_is_an_error_naming_the_module(pool):
    for rank, error in enumerate(pool.run(_count_changes, timeout=TIMEOUT)):
        assert error is not None, f"rank {rank}: trained on through a forward that skipped a call"
        assert "CallCountError" in error and "'h'" in error, f"rank {rank}: {error}"
