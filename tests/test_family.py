"""The rest of torchrec's pipeline family against their references, bit for bit, on 2 gloo ranks.

- EvalPipelineSparseDist: the model's own outputs (eval mode), parameters untouched.
- TrainPipelineFusedSparseDist: the plain loop.
- TrainPipelineSemiSync: a reference derived from torchrec's documented semantics
  (`semi_sync_reference`: the plain loop with the tables of two steps back swapped in for forward),
  and different from the plain loop once the warm-up (`start_batch`) is over; torchrec's own class
  where it runs (not on CPU: skipped with its error).
- StagedTrainPipeline (copy, a user stage, SparseDataDistUtil's input_dist stage) around the caller's
  own forward/backward/step: the plain loop on the transformed batches.

Table-wise and column-wise sharding, distinct batches per step and rank, one output per batch, then
StopIteration. Every comparison also has a negative twin (a reference that is off by one step) that
must differ, so a test that compares nothing cannot pass. Each case is a scenario on the module's
pair of ranks (tests/harness.py), asserted in its own test.
"""

from __future__ import annotations

import functools
import itertools

import pytest

from tests.harness import pytest_timeout

SHARDINGS = ("table_wise", "column_wise")
STEPS = 8
EVAL_CASES = list(itertools.product(("dlrm", "nested"), SHARDINGS))
FUSED_CASES = [(k, s, "") for k, s in itertools.product(("dlrm", "nested", "dict", "fp"), SHARDINGS)]
FUSED_CASES.append(
    ("fp", "column_wise", "after")
)  # the lookup after input_dist of i+1, on the caller's stream
FUSED_OPTIONS = {"": {}, "after": {"embedding_lookup_after_data_dist": True, "emb_lookup_stream": "current"}}
STAGED_CASES = list(itertools.product(("dlrm", "nested"), SHARDINGS))
START_BATCH = 3
SEMI_CASES = [(k, s, START_BATCH) for k, s in itertools.product(("dlrm", "nested"), SHARDINGS)]
SEMI_CASES.append(("dlrm", "table_wise", 900))  # all warm-up: the plain loop
STASH_CASES = [("nested", "table_wise"), ("dlrm", "column_wise")]
TIMEOUT = 150
pytestmark = [pytest.mark.timeout(pytest_timeout(TIMEOUT)), pytest.mark.slow]


def _tables(model) -> list:
    """This rank's shards of every embedding table of `model`, as tensors sharing the kernels'
    storage (writing them changes what the next lookup returns)."""
    from tests import models

    state = model.state_dict()
    return models.flat_tensors({k: v for k, v in state.items() if ".embedding_bags." in k})


def semi_sync_reference(model, opt, data: list, start_batch: int, stash: bool = False) -> list:
    """torchrec 1.8's TrainPipelineSemiSync, from its documentation and its `progress()`, written
    as the plain loop with old tables swapped in for forward.

    The docstring: from `start_batch` on, "each batch prediction is calculated on parameters which
    were last updated B-2, instead of the batch prior (ie. B-1)", so that the embedding all-to-all
    of B overlaps forward of B-1. In `progress()`, batch i+1's lookup starts after forward of i and
    before its backward (whose fused update changes the tables) when i >= start_batch; before, it
    starts after the optimizer step of i. The dense parameters are read as they are (the dense step
    of i-1 ran before forward of i). So forward of batch i reads the tables as they were before
    backward of batch i-1 when i-1 >= start_batch, and the current ones otherwise; the gradients of
    the embeddings go to the current tables (the fused update does not read the old weights).
    With `stash`: the dense step at batch i >= start_batch applies batch i-1's gradients
    (`_grad_swap`), and the step at start_batch is skipped (`_mlp_optimizer_step`).
    """
    import torch

    tables = _tables(model)
    before_backward: list | None = None  # the tables as batch i-1's backward found them
    stashed: dict = {}
    outputs = []
    for i, batch in enumerate(data):
        current = [t.clone() for t in tables]
        stale = i - 1 >= start_batch and before_backward is not None
        if stale:  # through .data: the kernel's autograd must not see the swap as a change
            for t, old in zip(tables, before_backward, strict=True):
                t.data.copy_(old)
        opt.zero_grad()
        loss, out = model(batch)
        if stale:
            for t, now in zip(tables, current, strict=True):
                t.data.copy_(now)
        before_backward = current
        torch.sum(loss).backward()
        outputs.append(out)
        if stash and i >= start_batch:
            grads = {name: p.grad for name, p in model.named_parameters()}
            for name, p in model.named_parameters():
                p.grad = stashed.get(name)
            stashed.update({name: g.clone() for name, g in grads.items() if g is not None})
            if i == start_batch:
                continue
        opt.step()
    return outputs


def _eval_case(rank: int, kind: str, sharding: str) -> dict:
    import torch

    import pipeline
    from tests import models

    ref, _ = models.build(kind, sharding)
    ref.eval()
    with torch.no_grad():
        expected = [ref(b)[1] for b in models.batches(kind, STEPS, rank)]
    model, opt = models.build(kind, sharding)
    before = [t.clone() for t in models.flat_tensors(model.state_dict())]
    model.eval()
    pipe = pipeline.EvalPipelineSparseDist(model, opt, torch.device("cpu"))
    outputs, stopped = models.outputs_then_stop(pipe, iter(models.batches(kind, STEPS, rank)), STEPS)
    model.train()  # in training mode too: forward only, nothing stepped
    trained = models.run_to_end(pipe, iter(models.batches(kind, 3, rank, seed=7)))
    return {
        "outputs": models.bitwise_equal(expected, outputs),
        "shifted": models.bitwise_equal(expected[1:], outputs[:-1]),
        "params": models.bitwise_equal(before, models.flat_tensors(model.state_dict())),
        "stopped": stopped and len(trained) == 3,
        "no_grad": all(p.grad is None for p in model.parameters()),
        "not_pipelined": [m.fqn for m in pipe.rewrite_report.not_pipelined],
    }


def _train_case(
    rank: int, cls_name: str, kind: str, sharding: str, reference, *, compare=None, **options
) -> dict:
    """`cls_name` against `reference(model, opt, batches)`; `compare`: other references, whose
    equality with the pipeline is reported as `equals_<name>`."""
    import torch

    import pipeline
    from tests import models

    data = models.batches(kind, STEPS, rank)
    ref_model, ref_opt = models.build(kind, sharding)
    expected = reference(ref_model, ref_opt, data)
    model, opt = models.build(kind, sharding)
    pipe = getattr(pipeline, cls_name)(model, opt, torch.device("cpu"), **options)
    outputs, stopped = models.outputs_then_stop(pipe, iter(models.batches(kind, STEPS, rank)), STEPS)
    # the negative twin: the same reference with the last optimizer step skipped
    twin_model, twin_opt = models.build(kind, sharding)
    reference(twin_model, twin_opt, data[:-1])
    result = {
        "outputs": models.bitwise_equal(expected, outputs),
        "params": models.bitwise_equal(ref_model.state_dict(), model.state_dict()),
        "twin_differs": not models.bitwise_equal(twin_model.state_dict(), model.state_dict()),
        "stopped": stopped,
        "not_pipelined": [m.fqn for m in pipe.rewrite_report.not_pipelined],
    }
    for name, other in (compare or {}).items():
        other_model, other_opt = models.build(kind, sharding)
        other_outputs = other(other_model, other_opt, data)
        result[f"equals_{name}"] = models.bitwise_equal(other_outputs, outputs) and models.bitwise_equal(
            other_model.state_dict(), model.state_dict()
        )
    return result


def _double_dense(batch):
    """A user stage: a gradient-less transform of the batch (its dense features doubled)."""
    import dataclasses

    from torchrec.datasets.utils import Batch

    if isinstance(batch, Batch):
        return Batch(batch.dense_features * 2, batch.sparse_features, batch.labels)
    return dataclasses.replace(batch, dense=batch.dense * 2)


def _staged_case(rank: int, kind: str, sharding: str, detach_at: int = -1) -> dict:
    """The staged pipeline around the caller's loop; after `detach_at` steps, `sdd.detach()` and a
    direct call of the plain model (the next progress() re-attaches)."""
    import torch

    import pipeline
    from pipeline.pipelines.core import to_device
    from tests import models

    data = [_double_dense(b) for b in models.batches(kind, STEPS, rank)]
    ref_model, ref_opt = models.build(kind, sharding)
    expected = models.plain_loop(ref_model, ref_opt, data)
    twin_model, twin_opt = models.build(kind, sharding)
    models.plain_loop(twin_model, twin_opt, data[:-1])
    model, opt = models.build(kind, sharding)
    sdd = pipeline.SparseDataDistUtil(model)
    pipe = pipeline.StagedTrainPipeline(
        [
            pipeline.PipelineStage("data_copy", lambda b: to_device(b, torch.device("cpu"), True)),
            pipeline.PipelineStage("double_dense", _double_dense),
            sdd.start_sparse_data_dist_stage(),
        ]
    )
    it = iter(models.batches(kind, STEPS, rank))
    outputs = []
    while (batch := pipe.progress(it)) is not None:
        opt.zero_grad()
        loss, out = model(batch)
        torch.sum(loss).backward()
        opt.step()
        outputs.append(out)
        assert len(outputs) <= STEPS, "no end of data"
        if len(outputs) == detach_at:
            sdd.detach()
            with torch.no_grad():
                model(models.batches(kind, 1, rank, seed=5)[0])
    return {
        "outputs": models.bitwise_equal(expected, outputs),
        "params": models.bitwise_equal(ref_model.state_dict(), model.state_dict()),
        "twin_differs": not models.bitwise_equal(twin_model.state_dict(), model.state_dict()),
        "stopped": pipe.progress(it) is None,
        "not_pipelined": [m.fqn for m in sdd.rewrite_report.not_pipelined],
    }


STREAM_PIPELINES = {
    "TrainPipelineFusedSparseDist": {},
    "TrainPipelineSemiSync": {"start_batch": 2},
    "EvalPipelineSparseDist": {},
}


def _streams_case(rank: int, name: str, broken: bool) -> dict:
    """The pipeline on fake named streams that log every hand-off (`RecordingStreams`)."""
    import torch

    import pipeline
    from tests import models

    model, opt = models.build("dlrm", "table_wise")
    result, streams = models.recorded_run(
        lambda streams: getattr(pipeline, name)(
            model, opt, torch.device("cpu"), streams=streams, **STREAM_PIPELINES[name]
        ),
        models.batches("dlrm", STEPS, rank, seed=9),
        broken=broken,
    )
    result["fences"] = sum(1 for e in streams.log if e == ("wait", "data_dist", "default"))
    return result


UNEVEN = {
    "TrainPipelineSemiSync": [(8, 7), (8, 4), (3, 8), (8, 1), (8, 0)],
    "TrainPipelineFusedSparseDist": [(8, 5), (3, 8), (8, 1)],
    "EvalPipelineSparseDist": [(8, 5), (3, 8), (8, 1)],
}
LIFECYCLE_OPTIONS = {
    "TrainPipelineSemiSync": {"start_batch": 2},
    "TrainPipelineFusedSparseDist": {},
    "EvalPipelineSparseDist": {},
}


def _eval_reference(model, optimizer, batches):
    """What EvalPipelineSparseDist returns: the model's own outputs, under no_grad, nothing stepped."""
    import torch

    with torch.no_grad():
        return [model(b)[1] for b in batches]


def _reference_of(name: str):
    from tests import models

    if name == "TrainPipelineSemiSync":
        return functools.partial(semi_sync_reference, start_batch=2)
    if name == "EvalPipelineSparseDist":
        return _eval_reference
    return models.plain_loop


def _uneven_case(rank: int, name: str, counts: tuple[int, int]) -> dict:
    import warnings

    import torch

    import pipeline
    from tests import models

    common = min(counts)
    ref_model, ref_opt = models.build("dlrm", "table_wise")
    expected = _reference_of(name)(ref_model, ref_opt, models.batches("dlrm", common, rank))
    model, opt = models.build("dlrm", "table_wise")
    pipe = getattr(pipeline, name)(model, opt, torch.device("cpu"), **LIFECYCLE_OPTIONS[name])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outputs = models.run_to_end(pipe, iter(models.batches("dlrm", counts[rank], rank)))
    return {
        "count": len(outputs),
        "outputs": models.bitwise_equal(expected, outputs),
        "params": models.bitwise_equal(ref_model.state_dict(), model.state_dict()),
        "untrained": len(pipe.untrained_batches),
        "warned": any("not trained" in str(w.message) for w in caught),
    }


def _switch_case(rank: int, name: str) -> dict:
    """3 steps, detach and a direct call of the model, an eval pass on another iterator, then the
    rest: the training batches are the reference's, as if nothing happened in between."""
    import torch

    import pipeline
    from tests import models

    data = models.batches("dlrm", STEPS, rank)
    ref_model, ref_opt = models.build("dlrm", "table_wise")
    expected = _reference_of(name)(ref_model, ref_opt, data)
    model, opt = models.build("dlrm", "table_wise")
    pipe = getattr(pipeline, name)(model, opt, torch.device("cpu"), **LIFECYCLE_OPTIONS[name])
    it = iter(models.batches("dlrm", STEPS, rank))
    outputs = [pipe.progress(it) for _ in range(3)]
    pipe.detach()
    with torch.no_grad():
        model(models.batches("dlrm", 1, rank, seed=5)[0])  # the plain model runs while detached
    model.eval()
    evals = models.run_to_end(pipe, iter(models.batches("dlrm", 3, rank, seed=6)))
    model.train()
    outputs += models.run_to_end(pipe, it)
    return {
        "outputs": models.bitwise_equal(expected, outputs),
        "params": models.bitwise_equal(ref_model.state_dict(), model.state_dict()),
        "evals": len(evals),
    }


def _shared_parameters_case(rank: int) -> str | None:
    """SemiSync with strict=True on a model whose sharded module has parameters in the dense
    optimizer (position weights): every rank refuses it on the first step."""
    import torch

    import pipeline
    from tests import models

    model, opt = models.build("fp", "table_wise")
    pipe = pipeline.TrainPipelineSemiSync(model, opt, torch.device("cpu"), start_batch=0, strict=True)
    try:
        pipe.progress(iter(models.batches("fp", 4, 0)))
    except ValueError as e:
        return str(e)
    return None


def _fused(rank: int, world_size: int, kind: str, sharding: str, option: str) -> dict:
    from tests import models

    return _train_case(
        rank, "TrainPipelineFusedSparseDist", kind, sharding, models.plain_loop, **FUSED_OPTIONS[option]
    )


def _semi(rank: int, world_size: int, kind: str, sharding: str, start: int) -> dict:
    from tests import models

    stale = functools.partial(semi_sync_reference, start_batch=start)
    return _train_case(
        rank,
        "TrainPipelineSemiSync",
        kind,
        sharding,
        stale,
        compare={"plain_loop": models.plain_loop},
        start_batch=start,
    )


def _stash(rank: int, world_size: int, kind: str, sharding: str) -> dict:
    stale = functools.partial(semi_sync_reference, start_batch=START_BATCH, stash=True)
    no_stash = functools.partial(semi_sync_reference, start_batch=START_BATCH)
    return _train_case(
        rank,
        "TrainPipelineSemiSync",
        kind,
        sharding,
        stale,
        compare={"no_stash": no_stash},
        start_batch=START_BATCH,
        stash_gradients=True,
    )


def _on_ranks(rank: int, world_size: int, fn, *args):
    """`fn(rank, *args)`: the module's cases as harness scenarios."""
    return fn(rank, *args)


def _check_common(r: dict) -> None:
    assert r["not_pipelined"] == [], r
    assert r["stopped"], f"no StopIteration after {STEPS} outputs"


def _check_trained(r: dict, rank: int, reference: str, *, twin: bool = True) -> None:
    """Common checks, then per-step outputs and final parameters equal to `reference`, and (with
    `twin`) a reference with one optimizer step skipped that does not match."""
    _check_common(r)
    assert r["outputs"], f"rank {rank}: per-step outputs differ from {reference}"
    assert r["params"], f"rank {rank}: final parameters differ from {reference}"
    if twin:
        assert r["twin_differs"], "a skipped optimizer step would go unnoticed"


@pytest.mark.parametrize(("kind", "sharding"), EVAL_CASES)
def test_eval_pipeline_gives_the_models_outputs(pool, kind, sharding):
    for rank, r in enumerate(pool.run(_on_ranks, _eval_case, kind, sharding, timeout=TIMEOUT)):
        _check_common(r)
        assert r["outputs"], f"rank {rank}: outputs differ from model.eval() outputs"
        assert not r["shifted"], "batches are not distinct: the comparison cannot fail"
        assert r["params"], f"rank {rank}: the eval pipeline changed parameters"
        assert r["no_grad"], f"rank {rank}: the eval pipeline ran backward"


@pytest.mark.parametrize(("kind", "sharding", "option"), FUSED_CASES)
def test_fused_sparse_dist_equals_plain_loop(pool, kind, sharding, option):
    for rank, r in enumerate(pool.run(_fused, kind, sharding, option, timeout=TIMEOUT)):
        _check_trained(r, rank, "the plain loop")


@pytest.mark.parametrize(("kind", "sharding"), STAGED_CASES)
def test_staged_pipeline_with_user_stages_equals_plain_loop(pool, kind, sharding):
    for rank, r in enumerate(pool.run(_on_ranks, _staged_case, kind, sharding, timeout=TIMEOUT)):
        _check_trained(r, rank, "the plain loop")


def test_staged_pipeline_detached_mid_run_equals_plain_loop(pool):
    for rank, r in enumerate(pool.run(_on_ranks, _staged_case, "dlrm", "column_wise", 3, timeout=TIMEOUT)):
        _check_trained(r, rank, "the plain loop")


def _torchrec_semi_sync(rank: int, world_size: int, start_batch: int) -> dict:
    """torchrec's own TrainPipelineSemiSync against ours and the reference (where it runs)."""
    import torch
    from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSemiSync as Theirs

    import pipeline
    from tests import models

    data = models.batches("dlrm", STEPS, rank)
    runs = {}
    for who, cls in (("ours", pipeline.TrainPipelineSemiSync), ("torchrec", Theirs)):
        model, opt = models.build("dlrm", "table_wise")
        pipe = cls(model, opt, torch.device("cpu"), start_batch=start_batch)
        try:
            outputs = models.run_to_end(pipe, iter(models.batches("dlrm", STEPS, rank)))
        except Exception as e:
            return {"torchrec_error": f"{type(e).__name__}: {e}"} if who == "torchrec" else {}
        runs[who] = (outputs, model.state_dict())
    ref_model, ref_opt = models.build("dlrm", "table_wise")
    expected = semi_sync_reference(ref_model, ref_opt, data, start_batch)
    return {
        "torchrec_error": None,
        "ours_equal_theirs": models.bitwise_equal(runs["ours"], runs["torchrec"]),
        "theirs_equal_reference": models.bitwise_equal(runs["torchrec"], (expected, ref_model.state_dict())),
    }


def test_semi_sync_equals_torchrecs_own_class(pool):
    results = pool.run(_torchrec_semi_sync, START_BATCH, timeout=TIMEOUT)
    if results[0]["torchrec_error"] is not None:
        # torchrec's class raises in its first progress() on CPU ("unknown parameter type"); on a
        # GPU, tests/test_cuda.py compares it with ours
        pytest.skip(f"torchrec's TrainPipelineSemiSync does not run on CPU: {results[0]['torchrec_error']}")
    for r in results:
        assert r["theirs_equal_reference"], "the reference is not torchrec's semantics"
        assert r["ours_equal_theirs"], "not torchrec's TrainPipelineSemiSync, bit for bit"


@pytest.mark.parametrize(("kind", "sharding", "start_batch"), SEMI_CASES)
def test_semi_sync_equals_the_stale_loop(pool, kind, sharding, start_batch):
    for rank, r in enumerate(pool.run(_semi, kind, sharding, start_batch, timeout=TIMEOUT)):
        _check_trained(r, rank, "the semi-sync reference")
        # the documented difference: stale embeddings change the numbers after the warm-up
        assert r["equals_plain_loop"] == (start_batch >= STEPS - 1), r


def test_semi_sync_refuses_shared_parameters_under_strict(pool):
    for message in pool.run(_on_ranks, _shared_parameters_case, timeout=TIMEOUT):
        assert message and "dense optimizer" in message


@pytest.mark.parametrize(("kind", "sharding"), STASH_CASES)
def test_semi_sync_with_stashed_gradients(pool, kind, sharding):
    for rank, r in enumerate(pool.run(_stash, kind, sharding, timeout=TIMEOUT)):
        _check_trained(r, rank, "the semi-sync reference", twin=False)
        assert not r["equals_no_stash"], "stash_gradients made no difference"


@pytest.mark.parametrize(("name", "counts"), [(n, c) for n, cases in UNEVEN.items() for c in cases])
def test_uneven_data_trains_the_common_count(pool, name, counts):
    common = min(counts)
    for rank, r in enumerate(pool.run(_on_ranks, _uneven_case, name, counts, timeout=TIMEOUT)):
        assert r["count"] == common, f"rank {rank}: {r['count']} outputs, expected {common}"
        assert r["outputs"] and r["params"], f"rank {rank}: not the reference on {common} batches"
        longer = counts[rank] > common
        assert (r["untrained"] > 0) == longer and r["warned"] == longer, r


@pytest.mark.parametrize("name", ["TrainPipelineSemiSync", "TrainPipelineFusedSparseDist"])
def test_detach_and_eval_pass_mid_run(pool, name):
    for r in pool.run(_on_ranks, _switch_case, name, timeout=TIMEOUT):
        assert r["evals"] == 3
        assert r["outputs"] and r["params"], "the training batches changed"


EXPECTED_STAGES = {
    "copy": ["memcpy"],
    "input_dist::start": ["data_dist"],
    "input_dist::splits": ["data_dist"],
    "lookup": ["data_dist"],
    "forward": ["default"],
    "backward": ["default"],
    "optimizer": ["default"],
}


_DIST = ("copy", "input_dist::start", "input_dist::splits")
STAGES_OF = {
    "TrainPipelineFusedSparseDist": (*_DIST, "lookup", "forward", "backward", "optimizer"),
    "TrainPipelineSemiSync": (*_DIST, "lookup", "forward", "backward", "optimizer"),
    "EvalPipelineSparseDist": (*_DIST, "forward"),
}


@pytest.mark.parametrize("name", STREAM_PIPELINES)
def test_stream_hand_offs(pool, name):
    correct = pool.run(_on_ranks, _streams_case, name, False, timeout=TIMEOUT)
    broken = pool.run(_on_ranks, _streams_case, name, True, timeout=TIMEOUT)
    for r, b in zip(correct, broken, strict=True):
        assert r["outputs"] == STEPS and r["error"] is None
        assert r["checked"] >= 2 * STEPS  # at least the batch and (or) the lookup, per batch
        # every stage of the pipeline, each on its stream, once per batch: a missing stage fails
        assert r["stages"] == {stage: EXPECTED_STAGES[stage] for stage in STAGES_OF[name]}
        runs = r["runs"]
        # the splits stage may run more than once for a batch (it is re-entered while waiting)
        assert runs.pop("input_dist::splits") >= STEPS
        assert runs == {stage: STEPS for stage in STAGES_OF[name] if stage != "input_dist::splits"}
        if name != "EvalPipelineSparseDist":
            # the lookup stream waits for the caller's after each batch's backward
            assert r["fences"] >= STEPS
        assert b["error"] and "without a wait" in b["error"]


# -- the schedule alone (one process): which batches run, against torchrec's class of the same name


@pytest.mark.parametrize(
    ("name", "execute_all_batches"),
    [
        *itertools.product(["TrainPipelineFusedSparseDist", "TrainPipelineSemiSync"], [True, False]),
        ("EvalPipelineSparseDist", True),
    ],
)
def test_schedule_matches_torchrec(name, execute_all_batches):
    from torchrec.distributed.train_pipeline import train_pipelines as theirs

    import pipeline
    from tests.test_torchrec_parity import schedule

    options = {} if name.startswith("Eval") else {"execute_all_batches": execute_all_batches}
    if name == "TrainPipelineSemiSync":
        options["start_batch"] = 1
    for n in range(9):
        ours = schedule(getattr(pipeline, name), n, **options)
        assert ours == schedule(getattr(theirs, name), n, **options), f"{n} batches"
        assert ours == list(range(len(ours)))


# -- StagedTrainPipeline alone (one process): the order of the stages, the end, a flush


def _tracing_stage(name: str, log: list):
    import pipeline

    def run(batch):
        log.append((name, batch[0]))
        return batch[0], [*batch[1], name]

    return pipeline.PipelineStage(name, run)


def test_staged_order_end_and_new_iterator():
    import pipeline

    log: list = []
    pipe = pipeline.StagedTrainPipeline([_tracing_stage("a", log), _tracing_stage("b", log)])
    it = iter([(i, []) for i in range(4)])
    outputs = []
    while (batch := pipe.progress(it)) is not None:
        outputs.append(batch)
    assert outputs == [(i, ["a", "b"]) for i in range(4)]
    assert pipe.progress(it) is None and pipe.progress(it) is None
    # the fill runs a and b on batch 0 and a on batch 1; each progress() then runs, newest first,
    # a on batch i+2 and b on batch i+1
    assert log[:5] == [("a", 0), ("b", 0), ("a", 1), ("a", 2), ("b", 1)]
    assert sorted(log) == sorted((s, i) for s in "ab" for i in range(4))
    assert pipe.progress(iter([(9, [])])) == (9, ["a", "b"])  # a new iterator fills again


def test_staged_flush_returns_the_batches_in_flight_then_fills_again():
    import pipeline

    log: list = []
    ends: list = []
    pipe = pipeline.StagedTrainPipeline(
        [_tracing_stage("a", log), _tracing_stage("b", log)], on_flush_end=lambda: ends.append(len(log))
    )
    it = iter([(i, []) for i in range(6)])
    outputs = [pipe.progress(it)[0] for _ in range(2)]
    pipe.set_flush(True)
    outputs += [pipe.progress(it)[0] for _ in range(2)]  # batches 2 and 3 were in flight
    assert ("a", 4) not in log, "a flushing pipeline fetched a batch"
    outputs += [pipe.progress(it)[0] for _ in range(2)]  # flushed: on_flush_end, then a new fill
    assert outputs == list(range(6)) and len(ends) == 1
    assert pipe.progress(it) is None
