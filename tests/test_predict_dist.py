"""The prediction tool (`benchmarks.predictor`) on 2 gloo ranks: what it reads of a sharded model and its
batch, the link it probes, and the schedule it says to pin (`input_dist_schedule=...`), the same on
every rank (each scenario its own test). The pipeline itself never predicts.

The machine's costs are measured once into a cache of this module (`$TORCHREC_PIPELINE_CACHE` set by
each scenario), so the first scenario takes some 15 s more."""

from __future__ import annotations

import pytest

from tests.harness import pytest_timeout

TIMEOUT = 240
STEPS = 12
pytestmark = [pytest.mark.timeout(pytest_timeout(TIMEOUT)), pytest.mark.slow]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    """One cache of machine costs for the module's scenarios (measured by the first)."""
    return str(tmp_path_factory.mktemp("costs"))


def _cache(path: str) -> None:
    import os

    os.environ["TORCHREC_PIPELINE_CACHE"] = path


def _predicts(rank: int, world_size: int, cache: str) -> dict:
    _cache(cache)
    import benchmarks.predictor
    from benchmarks.predictor import workload_of
    from tests import models

    model, _ = models.build("dlrm", "table_wise")
    batch = models.batches("dlrm", 1, rank)[0]
    workload = workload_of(model, batch)
    prediction = benchmarks.predictor.predict(model, batch)  # probes the link: a collective call
    at_eight = benchmarks.predictor.predict(model, batch, world_size=8, link="1gbit")
    return {
        "tables": len(workload.tables),
        "ranks": sorted({r for t in workload.tables for r in t.ranks}),
        "batch": workload.batch_size,
        "world": (prediction.world_size, at_eight.world_size),
        "link": prediction.link,
        "pipelines": sorted({s.pipeline for s in prediction.steps}),
        "finite": all(0 < s.step_ms < 1e4 for s in (*prediction.steps, *at_eight.steps)),
        "table": str(prediction),
        "schedules": prediction.schedule_ms("sparse-dist"),
    }


def test_predict_reads_the_model_and_probes_the_link(pool, cache):
    ranks = pool.run(_predicts, cache, timeout=TIMEOUT)
    for rank, r in enumerate(ranks):
        assert r["ranks"] == [0, 1] and r["tables"] >= 2, f"rank {rank}: tables on both ranks, {r}"
        assert r["world"] == (2, 8) and r["link"] == "probe", f"rank {rank}: {r['world']}, {r['link']}"
        assert r["pipelines"] == ["base", "fused", "prefetch", "semi-sync", "sparse-dist"], f"rank {rank}"
        assert r["finite"], f"rank {rank}: a step out of range in\n{r['table']}"
        assert "winner:" in r["table"], f"rank {rank}: no winner line in\n{r['table']}"


def _pin(rank: int, world_size: int, cache: str, pipe_name: str) -> dict:
    _cache(cache)
    import torch

    import pipeline
    from benchmarks.predictor.pin import schedule_to_pin
    from tests import models

    model, opt = models.build("dlrm", "table_wise")
    kind = {"TrainPipelineFusedSparseDist": "fused"}.get(pipe_name, "sparse-dist")
    pin = schedule_to_pin(model, models.batches("dlrm", 1, rank)[0], pipeline=kind)  # a collective call
    pipe = getattr(pipeline, pipe_name)(model, opt, torch.device("cpu"), input_dist_schedule=pin.schedule)
    schedules = []
    it = iter(models.batches("dlrm", STEPS + 4, rank))
    for _ in range(STEPS):
        pipe.progress(it)
        schedules.append(pipe.input_dist_schedule)
    return {"pin": pin, "schedules": schedules, "watch": pipe.tuner is not None}


@pytest.mark.parametrize("pipe_name", ["TrainPipelineSparseDist", "TrainPipelineFusedSparseDist"])
def test_every_rank_pins_the_same_schedule_from_the_prediction(pool, cache, pipe_name):
    first, second = pool.run(_pin, cache, pipe_name, timeout=TIMEOUT)
    pin = first["pin"]
    assert set(pin.predicted_ms) == {"early", "late", "early-shared", "late-own"}, pin
    assert pin == second["pin"], "the ranks averaged their predictions, and pin alike"
    assert first["schedules"] == second["schedules"], "every step under the same schedule on both ranks"
    assert str(pin).startswith(f"input_dist_schedule={pin.schedule!r}: "), str(pin)
    if pin.schedule == "adaptive":  # the prediction could not tell: the default's watch decides
        assert first["watch"] and "within the noise" in pin.reason, pin
    else:  # pinned: no watch, the pinned schedule from the first step to the last
        assert not first["watch"] and set(first["schedules"]) == {pin.schedule}, first["schedules"]
