"""Pipeline lifecycle on 2 gloo ranks: exhaustion, epochs, eval switches, detach, exceptions,
execute_all_batches=False, the stream checker and the profiler labels.

Every scenario is compared with a plain-loop reference doing the same sequence of operations. Each
scenario runs on the module's pair of ranks (tests/harness.py) and is asserted in its own test.
"""

from __future__ import annotations

import pytest

from tests.harness import pytest_timeout

PIPELINES = ("TrainPipelineBase", "TrainPipelineSparseDist", "PrefetchTrainPipelineSparseDist")
KIND, SHARDING, N = "nested", "column_wise", 8
TIMEOUT = 150
pytestmark = pytest.mark.timeout(pytest_timeout(TIMEOUT))


def _pair(pipe_name: str, **options):
    import torch

    import pipeline
    from tests import models

    ref, ref_opt = models.build(KIND, SHARDING)
    model, opt = models.build(KIND, SHARDING)
    pipe = getattr(pipeline, pipe_name)(model, opt, torch.device("cpu"), **options)
    return ref, ref_opt, model, pipe


def _epochs(rank: int, pipe_name: str) -> dict:
    from tests import models

    ref, ref_opt, model, pipe = _pair(pipe_name)
    e1, e2 = models.batches(KIND, N, rank, seed=1), models.batches(KIND, 5, rank, seed=2)
    expected = models.plain_loop(ref, ref_opt, e1) + models.plain_loop(ref, ref_opt, e2)
    it1 = iter(e1)
    got = models.run_to_end(pipe, it1)
    again = models.run_to_end(pipe, it1)  # StopIteration again, nothing repeated
    got += models.run_to_end(pipe, iter(e2))
    return {
        "counts": (len(got), len(again)),
        "equal": models.bitwise_equal(expected, got),
        "params": models.bitwise_equal(ref.state_dict(), model.state_dict()),
    }


def _eval_switch(rank: int, pipe_name: str) -> dict:
    import torch

    import pipeline
    from tests import models

    ref, ref_opt = models.build(KIND, SHARDING)
    model, opt = models.build(KIND, SHARDING)

    def predictions_in_eval(batch):  # a model that returns only predictions in eval
        loss, logits = model(batch)
        return (loss, logits) if model.training else logits

    pipe = getattr(pipeline, pipe_name)(model, opt, torch.device("cpu"), custom_model_fwd=predictions_in_eval)
    train, evals = models.batches(KIND, N, rank, seed=3), models.batches(KIND, 4, rank, seed=4)
    expected = models.plain_loop(ref, ref_opt, train[:3])
    ref.eval()
    with torch.no_grad():
        expected_eval = [ref(b)[1] for b in evals]
    ref.train()
    expected += models.plain_loop(ref, ref_opt, train[3:])

    it = iter(train)
    got = [pipe.progress(it) for _ in range(3)]
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    model.eval()
    got_eval = models.run_to_end(pipe, iter(evals))
    grad_in_eval = not models.bitwise_equal(grads, [p.grad for p in model.parameters()])
    model.train()
    got += models.run_to_end(pipe, it)
    return {
        "counts": (len(got), len(got_eval)),
        "equal": models.bitwise_equal(expected, got),
        "eval_equal": models.bitwise_equal(expected_eval, got_eval),
        "eval_is_tensor": all(isinstance(x, torch.Tensor) for x in got_eval),
        "params": models.bitwise_equal(ref.state_dict(), model.state_dict()),
        "grad_in_eval": grad_in_eval,
    }


def _eval_pair(rank: int, pipe_name: str) -> bool:
    """A model returning (loss, output) in eval: progress returns output, as torchrec does."""
    import torch

    from tests import models

    ref, _, model, pipe = _pair(pipe_name)
    data = models.batches(KIND, 3, rank, seed=11)
    ref.eval()
    model.eval()
    with torch.no_grad():
        expected = [ref(b)[1] for b in data]
    return models.bitwise_equal(expected, models.run_to_end(pipe, iter(data)))


def _detach(rank: int, pipe_name: str) -> dict:
    import torch

    from tests import models

    ref, ref_opt, model, pipe = _pair(pipe_name)
    data, probe = models.batches(KIND, N, rank, seed=5), models.batches(KIND, 1, rank, seed=6)[0]
    expected = models.plain_loop(ref, ref_opt, data[:3])
    with torch.no_grad():
        expected_probe = ref(probe)
    expected += models.plain_loop(ref, ref_opt, data[3:])
    it = iter(data)
    got = [pipe.progress(it) for _ in range(3)]
    pipe.detach()
    restored = all("forward" not in vars(m) for m in model.modules())
    with torch.no_grad():
        got_probe = model(probe)  # the plain model, mid-run
    got += models.run_to_end(pipe, it)  # re-attaches, in-flight batches resume
    return {
        "restored": restored,
        "probe_equal": models.bitwise_equal(expected_probe, got_probe),
        "equal": len(got) == N and models.bitwise_equal(expected, got),
        "params": models.bitwise_equal(ref.state_dict(), model.state_dict()),
    }


def _exception(rank: int, pipe_name: str) -> dict:
    import torch

    from tests import models

    _, _, model, pipe = _pair(pipe_name)
    data = models.batches(KIND, N, rank, seed=7)
    data[4].dense = torch.ones(models.BATCH, models.DENSE + 1)  # a bad batch: wrong dense width
    it = iter(data)
    error = None
    try:
        models.run_to_end(pipe, it)
    except RuntimeError as e:
        error = str(e)
    detach = getattr(pipe, "detach", lambda: None)
    detach()
    restored = all("forward" not in vars(m) for m in model.modules())
    with torch.no_grad():
        loss, _ = model(data[0])  # the plain model runs after the failure
    return {"error": error, "restored": restored, "plain_runs": bool(torch.isfinite(loss))}


class _Counting:
    """An iterator over a list that counts the batches taken from it."""

    def __init__(self, data: list) -> None:
        self.data, self.taken = data, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.taken >= len(self.data):
            raise StopIteration
        self.taken += 1
        return self.data[self.taken - 1]


def _reset(rank: int, pipe_name: str) -> dict:
    """3 steps, then reset(): the batches fetched ahead are dropped, not trained; progress() on the
    same iterator then goes on from its next batch, and on a new one starts cleanly."""
    from tests import models

    ref, ref_opt, model, pipe = _pair(pipe_name)
    data = models.batches(KIND, N, rank, seed=13)
    it = _Counting(data)
    got = [pipe.progress(it) for _ in range(3)]
    fetched = it.taken
    pipe.reset()
    got += models.run_to_end(pipe, it)
    other = models.batches(KIND, 3, rank, seed=14)
    got += models.run_to_end(pipe, iter(other))
    expected = models.plain_loop(ref, ref_opt, data[:3] + data[fetched:] + other)
    return {
        "dropped": fetched - 3,
        "count": len(got),
        "equal": models.bitwise_equal(expected, got),
        "params": models.bitwise_equal(ref.state_dict(), model.state_dict()),
    }


def _no_execute_all(rank: int, pipe_name: str) -> dict:
    from tests import models

    ref, ref_opt, _, pipe = _pair(pipe_name, execute_all_batches=False)
    data = models.batches(KIND, N, rank, seed=8)
    got = models.run_to_end(pipe, iter(data))
    expected = models.plain_loop(ref, ref_opt, data[: len(got)])
    return {"count": len(got), "equal": models.bitwise_equal(expected, got)}


def _streams(rank: int, pipe_name: str, broken: bool) -> dict:
    import torch

    import pipeline
    from tests import models

    model, opt = models.build(KIND, SHARDING)
    result, _ = models.recorded_run(
        lambda streams: getattr(pipeline, pipe_name)(model, opt, torch.device("cpu"), streams=streams),
        models.batches(KIND, N, rank, seed=9),
        broken=broken,
    )
    return result


def _groups(rank: int, pipe_name: str) -> dict:
    """The input all-to-alls move to their own group on the second batch, and back on detach."""
    import torch.distributed as dist

    import pipeline
    from rewrite.replay import kjt_all_to_alls
    from tests import models

    def pgs(model):
        return [a2a._pg for a2a in kjt_all_to_alls(model)]

    out = {}
    for option in ("early", "late"):
        ref, ref_opt, model, pipe = _pair(pipe_name, input_dist=pipeline.InputDistOptions(schedule=option))
        data = models.batches(KIND, N, rank, seed=11)
        expected = models.plain_loop(ref, ref_opt, data)
        it = iter(data)
        got = [pipe.progress(it) for _ in range(3)]  # the first call already starts batch 2
        during = pgs(model)
        pipe.detach()
        original = pgs(model)
        got += [pipe.progress(it)]
        reattached = pgs(model)
        got += models.run_to_end(pipe, it)
        out[option] = {
            "a2as": len(original),
            "original_is_world": all(pg is dist.group.WORLD for pg in original),
            "moved": all(p is not q for p, q in zip(original, during, strict=True)),
            "unchanged": all(p is q for p, q in zip(original, during, strict=True)),
            "one_own_group": len({id(p) for p in during}) == 1,
            "reused": all(p is q for p, q in zip(during, reattached, strict=True)),
            "equal": len(got) == N and models.bitwise_equal(expected, got),
            "params": models.bitwise_equal(ref.state_dict(), model.state_dict()),
        }
    return out


def _adaptive(rank: int, pipe_name: str, verdict: str, schedule: str | None = None) -> dict:
    """The default schedule's watch, made to try early at once on a tiny model: every rank moves
    at the same step, and back ("back") or not ("kept"), bit for bit across both switches; or back,
    then early again and back ("again": an unsure verdict tried once more), bit for bit across
    four. Its clock counts its own calls, so that both ranks see equal steps: a ratio of 1 after the
    switch ("back", "again"), or, under "kept", a ratio that any verdict keeps. `schedule`: the
    `input_dist_schedule` given beside the watch ("auto", the default's deprecated name; "late")."""
    import itertools
    import warnings

    import torch.distributed as dist

    from pipeline import InputDistOptions, ScheduleWatch
    from rewrite.replay import kjt_all_to_alls
    from tests import models

    counter = itertools.count()
    kept = verdict == "kept"

    class Watch(ScheduleWatch):
        def ratio(self, sure: float) -> float:  # "kept": every step after the switch reads as faster
            return 1e-3 if kept else ScheduleWatch.ratio(self, sure)

    watch = Watch(
        window=3,
        verify=3,
        warmup=0,
        settle=0,
        threshold=0.0001,
        margin=0.5,
        sure=0.0,
        retries=1 if verdict == "again" else 0,
        backoff=1,
        clock=lambda: float(next(counter)),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        options = InputDistOptions(watch=watch, schedule=schedule or "adaptive")
        ref, ref_opt, model, pipe = _pair(pipe_name, input_dist=options)
    steps = 3 * N
    data = models.batches(KIND, steps, rank, seed=13)
    expected = models.plain_loop(ref, ref_opt, data)
    ran: list[str] = []
    got = models.run_to_end(pipe, iter(data), schedules=ran)
    report = pipe.rewrite_report
    return {
        "ran": ran,
        "phase": watch.phase.value,
        "text": repr(pipe.tuner),
        "tuner": type(pipe.tuner).__name__ if pipe.tuner is not watch else "the watch given",
        "deprecated": [
            str(w.message)
            for w in caught
            if issubclass(w.category, DeprecationWarning) and "deprecated name" in str(w.message)
        ],
        "notes": [n for n in report.notes if n.startswith("input_dist schedule")],
        "pipelined": report.pipelined and not report.not_pipelined,
        "on_own_group": all(pg is not dist.group.WORLD for pg in (a._pg for a in kjt_all_to_alls(model))),
        "equal": len(got) == steps and models.bitwise_equal(expected, got),
        "params": models.bitwise_equal(ref.state_dict(), model.state_dict()),
    }


def _labels(rank: int, pipe_name: str) -> list[str]:
    import torch

    from tests import models

    _, _, _, pipe = _pair(pipe_name)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        models.run_to_end(pipe, iter(models.batches(KIND, 4, rank, seed=10)))
    return sorted({e.name for e in prof.events() if e.name.startswith("pipeline::")})


SCENARIOS = {
    "epochs": _epochs,
    "eval_switch": _eval_switch,
    "eval_pair": _eval_pair,
    "detach": _detach,
    "exception": _exception,
    "no_execute_all": _no_execute_all,
    "labels": _labels,
    "groups": _groups,
    "adaptive": _adaptive,
    "streams": _streams,
    "reset": _reset,
}


STAGED = "PrefetchTrainPipelineSparseDist+stage"
"""The Prefetch pipeline made to run its prefetch stage although the test model's fused kernels
have no prefetch work (which would make it run SparseDist's step)."""


def _scenario(rank: int, world_size: int, name: str, pipe_name: str, *args) -> object:
    if pipe_name != STAGED:
        return SCENARIOS[name](rank, pipe_name, *args)
    from unittest import mock

    with mock.patch("pipeline.pipelines.prefetch.prefetch_does_work", lambda module: True):
        return SCENARIOS[name](rank, "PrefetchTrainPipelineSparseDist", *args)


def _each(pool, name: str, pipe_name: str, *args) -> list:
    """The scenario's result on each rank."""
    return pool.run(_scenario, name, pipe_name, *args, timeout=TIMEOUT)


@pytest.mark.parametrize("pipe_name", PIPELINES)
def test_exhaustion_and_next_epoch(pool, pipe_name):
    for r in _each(pool, "epochs", pipe_name):
        assert r["counts"] == (N + 5, 0)
        assert r["equal"] and r["params"]


@pytest.mark.parametrize("pipe_name", PIPELINES)
def test_eval_switch_keeps_batches_apart(pool, pipe_name):
    for r in _each(pool, "eval_switch", pipe_name):
        assert r["counts"] == (N, 4)
        assert r["equal"], "training batches changed by the eval pass in between"
        assert r["eval_equal"] and r["eval_is_tensor"]
        assert r["params"]
        assert not r["grad_in_eval"], "eval ran backward"


@pytest.mark.parametrize("pipe_name", PIPELINES)
def test_eval_returns_output_of_loss_output_pair(pool, pipe_name):
    assert all(_each(pool, "eval_pair", pipe_name))


@pytest.mark.parametrize("pipe_name", PIPELINES[1:])
def test_detach_mid_run_then_reattach(pool, pipe_name):
    for r in _each(pool, "detach", pipe_name):
        assert r["restored"] and r["probe_equal"]
        assert r["equal"] and r["params"]


@pytest.mark.parametrize("pipe_name", PIPELINES)
def test_exception_propagates_and_detach_restores(pool, pipe_name):
    for r in _each(pool, "exception", pipe_name):
        assert r["error"] and "shapes cannot be multiplied" in r["error"]
        assert r["restored"] and r["plain_runs"]


# batches in flight after 3 steps: Base copies i+1, SparseDist and Prefetch copy i+2
AHEAD = {"TrainPipelineBase": 1, "TrainPipelineSparseDist": 2, "PrefetchTrainPipelineSparseDist": 2}


@pytest.mark.parametrize("pipe_name", PIPELINES)
def test_reset_drops_the_batches_in_flight(pool, pipe_name):
    for r in _each(pool, "reset", pipe_name):
        assert r["dropped"] == AHEAD[pipe_name], r
        assert r["count"] == N - r["dropped"] + 3, r
        assert r["equal"] and r["params"], "not the plain loop without the dropped batches"


@pytest.mark.parametrize(
    "name",
    [
        "TrainPipelineSparseDist",
        "PrefetchTrainPipelineSparseDist",
        "TrainPipelineFusedSparseDist",
        "TrainPipelineSemiSync",
        "EvalPipelineSparseDist",
    ],
)
def test_apply_jit_is_refused_with_what_to_do(name):
    import torch

    import pipeline

    model = torch.nn.Linear(1, 1)
    with pytest.raises(ValueError, match=r"apply_jit=True is not supported.*leave it False"):
        getattr(pipeline, name)(
            model, torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"), apply_jit=True
        )
    with pytest.raises(ValueError, match=r"apply_jit=True is not supported.*leave it False"):
        pipeline.SparseDataDistUtil(model, apply_jit=True)


@pytest.mark.parametrize("pipe_name", PIPELINES)
def test_execute_all_batches_false_drops_the_tail(pool, pipe_name):
    # as torchrec's: Base runs all, SparseDist drops the last 2, Prefetch too (torchrec's fixed rule,
    # not 1.8.0's 4; test_torchrec_parity.py checks every length against torchrec's classes)
    dropped = {"TrainPipelineBase": 0, "TrainPipelineSparseDist": 2, "PrefetchTrainPipelineSparseDist": 2}
    for r in _each(pool, "no_execute_all", pipe_name):
        assert r["count"] == N - dropped[pipe_name]
        assert r["equal"]


EXPECTED_STAGES = {
    "copy": ["memcpy"],
    "input_dist::start": ["data_dist"],
    "input_dist::splits": ["data_dist"],
    "prefetch": ["prefetch"],
    "forward": ["default"],
    "backward": ["default"],
    "optimizer": ["default"],
}


_DIST = ("input_dist::start", "input_dist::splits")
STAGES_OF = {
    "TrainPipelineBase": ("copy", "forward", "backward", "optimizer"),
    "TrainPipelineSparseDist": ("copy", *_DIST, "forward", "backward", "optimizer"),
    # fused kernels have nothing to prefetch: the Prefetch pipeline runs SparseDist's stages
    "PrefetchTrainPipelineSparseDist": ("copy", *_DIST, "forward", "backward", "optimizer"),
    STAGED: ("copy", *_DIST, "prefetch", "forward", "backward", "optimizer"),
}


@pytest.mark.parametrize("pipe_name", [*PIPELINES, STAGED])
def test_stream_checker_passes_on_every_pipeline(pool, pipe_name):
    for r in _each(pool, "streams", pipe_name, False):
        assert r["outputs"] == N and r["error"] is None
        # every stage of the pipeline, each on its stream, once per batch: a missing stage fails
        assert r["stages"] == {name: EXPECTED_STAGES[name] for name in STAGES_OF[pipe_name]}
        runs = r["runs"]
        # the splits stage may run more than once for a batch (it is re-entered while waiting)
        assert runs.pop("input_dist::splits", N) >= N
        assert runs == {name: N for name in STAGES_OF[pipe_name] if name != "input_dist::splits"}
        # each batch crosses from memcpy to the stream of its next stage once per consumer
        assert r["checked"] >= N


@pytest.mark.parametrize("pipe_name", [*PIPELINES, STAGED])
def test_stream_checker_catches_a_missing_wait(pool, pipe_name):
    for r in _each(pool, "streams", pipe_name, True):
        assert r["error"] and "without a wait" in r["error"]


@pytest.mark.parametrize("pipe_name", [*PIPELINES, STAGED])
def test_profiler_labels(pool, pipe_name):
    stages = {"copy", "forward", "backward", "optimizer"}
    if pipe_name != "TrainPipelineBase":
        stages |= {"input_dist::start", "input_dist::splits", "input_dist::wait"}
    if pipe_name == STAGED:
        stages |= {"prefetch"}
    for labels in _each(pool, "labels", pipe_name):
        found = {name.removeprefix("pipeline::").split("#")[0] for name in labels}
        found = {s for s in found if "::" not in s or s.startswith("input_dist")}
        assert found == stages


@pytest.mark.parametrize("pipe_name", PIPELINES[1:])
def test_input_all_to_alls_get_their_own_group(pool, pipe_name):
    for r in _each(pool, "groups", pipe_name):
        own, shared = r["early"], r["late"]
        assert own["a2as"] > 0 and own["original_is_world"]
        assert own["moved"] and own["one_own_group"], "input all-to-alls still on the shared group"
        assert own["original_is_world"], "detach() must put the original group back"
        assert own["reused"], "re-attaching must reuse the group, not create another"
        assert shared["unchanged"] and shared["original_is_world"], "'late' must not move them"
        for r2 in (own, shared):
            assert r2["equal"] and r2["params"]


@pytest.mark.parametrize("verdict", ["kept", "back"])
@pytest.mark.parametrize("pipe_name", PIPELINES[1:])
def test_default_schedule_moves_on_every_rank_at_once_and_stays_bit_for_bit(pool, pipe_name, verdict):
    ranks = _each(pool, "adaptive", pipe_name, verdict)
    assert ranks[0]["ran"] == ranks[1]["ran"], "the ranks switched at different steps"
    for r in ranks:
        assert r["equal"] and r["params"], f"not bit for bit across the switch ({verdict})"
        assert r["pipelined"], "a module fell back to its own forward"
        ran = r["ran"]
        assert ran[0] == "late" and "early" in ran, ran
        assert r["phase"] == verdict and ran[-1] == ("early" if verdict == "kept" else "late"), ran
        assert r["on_own_group"] == (verdict == "kept")
        said = "kept early" if verdict == "kept" else "back to late"
        assert "trying early" in r["text"] and said in r["text"], r["text"]
        assert len(r["notes"]) == 2, r["notes"]  # the report says both decisions


@pytest.mark.parametrize("pipe_name", PIPELINES[1:])
def test_an_unsure_verdict_tries_early_again_on_every_rank_at_once_bit_for_bit(pool, pipe_name):
    """Two trials of early, each going back: the ranks switch four times at the same steps, the
    all-to-alls end on torchrec's groups, and the numbers are the plain loop's."""
    ranks = _each(pool, "adaptive", pipe_name, "again")
    assert ranks[0]["ran"] == ranks[1]["ran"], "the ranks switched at different steps"
    for r in ranks:
        assert r["equal"] and r["params"], "not bit for bit across four switches"
        assert r["pipelined"], "a module fell back to its own forward"
        ran = r["ran"]
        runs = [s for i, s in enumerate(ran) if i == 0 or ran[i - 1] != s]
        assert runs == ["late", "early", "late", "early", "late"], ran
        assert r["phase"] == "back" and not r["on_own_group"]
        assert "once more from step" in r["text"] and "no further try (2 tries)" in r["text"], r["text"]
        assert len(r["notes"]) == 4, r["notes"]


@pytest.mark.parametrize("pipe_name", PIPELINES[1:])
def test_auto_runs_the_default_watch_under_a_deprecated_name(pool, pipe_name):
    for r in _each(pool, "adaptive", pipe_name, "kept", "auto"):
        said = r["deprecated"]
        assert len(said) == 1 and '"auto" is a deprecated name' in said[0], said
        assert r["tuner"] == "the watch given", f"pipe.tuner is {r['tuner']}, not the default's watch"
        assert r["ran"][0] == "late" and r["ran"][-1] == "early" and r["phase"] == "kept", r["ran"]
        assert r["equal"] and r["params"], "not bit for bit under 'auto'"


@pytest.mark.parametrize("pipe_name", PIPELINES[1:])
def test_twin_a_pinned_schedule_has_no_watch(pool, pipe_name):
    # the same watch given beside a pinned schedule: not used, pipe.tuner is None, nothing moves
    for r in _each(pool, "adaptive", pipe_name, "kept", "late"):
        assert r["tuner"] == "NoneType" and not r["deprecated"], r
        assert set(r["ran"]) == {"late"} and not r["on_own_group"], r["ran"]
        assert r["equal"] and r["params"]


def test_input_dist_schedule_rejects_unknown_values():
    import torch

    import pipeline

    with pytest.raises(ValueError, match="one of adaptive, early, late"):
        pipeline.TrainPipelineSparseDist(
            torch.nn.Linear(1, 1),
            None,
            torch.device("cpu"),
            input_dist=pipeline.InputDistOptions(schedule="x"),
        )
