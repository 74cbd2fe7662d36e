"""SparseDataDistUtil's prefetch and embedding-lookup stages in a StagedTrainPipeline, on 2 gloo ranks.

The model has table-wise and column-wise tables in one model (tests/user_models.py, "split": the
batch's KJT split between two collections), distinct batches per step and rank, the caller's own
zero_grad/forward/backward/step around `progress()`, one batch per call, then None.

- prefetch stage: bit for bit the plain loop; a twin with one optimizer step skipped differs.
- lookup stage (semi-synchronous): bit for bit `models.stale_lookup_loop`, a plain loop that looks
  batch i+1's embeddings up before applying batch i's update (written from the documented
  semantics); the plain loop differs (negative twin).
- a lookup stream without its stage in the list is refused at the first forward.
"""

from __future__ import annotations

import pytest

from tests.harness import pytest_timeout

STEPS = 6
TIMEOUT = 150
pytestmark = [pytest.mark.timeout(pytest_timeout(TIMEOUT)), pytest.mark.slow]


def _staged_run(model, opt, rank: int, extra: str, with_stage: bool = True) -> tuple[list, object, bool]:
    """The staged pipeline (copy, input_dist, `extra` stage) around the caller's loop."""
    import torch

    import pipeline
    from pipeline.pipelines.core import to_device
    from tests import user_models

    cpu_stream = torch.Stream("cpu")
    kwargs = (
        {"prefetch_stream": cpu_stream} if extra == "prefetch" else {"embedding_lookup_stream": cpu_stream}
    )
    sdd = pipeline.SparseDataDistUtil(model, None, **kwargs)
    stages = [
        pipeline.PipelineStage("data_copy", lambda b: to_device(b, torch.device("cpu"), True)),
        sdd.start_sparse_data_dist_stage(),
    ]
    if with_stage and extra == "prefetch":
        stages.append(
            pipeline.PipelineStage("prefetch", sdd.prefetch, sdd.prefetch_stream, sdd.load_prefetch)
        )
    elif with_stage:
        stages.append(sdd.start_embedding_lookup_stage())
    pipe = pipeline.StagedTrainPipeline(stages)
    it = iter(user_models.batches(STEPS, rank))
    outputs = []
    while (batch := pipe.progress(it)) is not None:
        opt.zero_grad()
        loss, out = model(batch)
        torch.sum(loss).backward()
        opt.step()
        outputs.append(out)
        assert len(outputs) <= STEPS, "no end of data"
    return outputs, sdd, pipe.progress(it) is None


def _case(rank: int, world_size: int, extra: str) -> dict:
    from tests import models, user_models

    data = user_models.batches(STEPS, rank)
    ref_model, ref_opt = user_models.build("split")
    if extra == "prefetch":
        expected = models.plain_loop(ref_model, ref_opt, data)
        twin_model, twin_opt = user_models.build("split")
        twin = models.plain_loop(twin_model, twin_opt, data[:-1])
    else:
        expected = models.stale_lookup_loop(ref_model, ref_opt, data)
        twin_model, twin_opt = user_models.build("split")
        twin = models.plain_loop(twin_model, twin_opt, data)
    model, opt = user_models.build("split")
    outputs, sdd, stopped = _staged_run(model, opt, rank, extra)
    return {
        "outputs": models.bitwise_equal(expected, outputs),
        "params": models.bitwise_equal(ref_model.state_dict(), model.state_dict()),
        "twin_differs": not models.bitwise_equal(twin_model.state_dict(), model.state_dict())
        and not models.bitwise_equal(twin, outputs),
        "count": len(outputs),
        "stopped": stopped,
        "not_pipelined": [m.fqn for m in sdd.rewrite_report.not_pipelined],
    }


def _missing_stage_case(rank: int, world_size: int) -> str:
    from tests import user_models

    model, opt = user_models.build("split")
    try:
        _staged_run(model, opt, rank, "lookup", with_stage=False)
    except RuntimeError as e:
        return str(e)
    return "no error"


def _forward_stream_case(rank: int, world_size: int) -> list[str]:
    """The stream each sharded module's `prefetch()` is told its forward runs on, with the stage
    on the prefetch stream (fbgemm's caching kernels refuse the prefetch stream itself)."""
    from unittest import mock

    import torch
    from torchrec.distributed.types import ShardedModule

    import pipeline
    from tests import streamcheck, user_models

    model, opt = user_models.build("split")
    told: list[str] = []
    for module in model.modules():
        if isinstance(module, ShardedModule):

            def prefetch(*args, _own=module.prefetch, **kwargs):
                told.append(kwargs["forward_stream"].name)
                return _own(*args, **kwargs)

            module.prefetch = prefetch
    streams = streamcheck.RecordingStreams()
    sdd = pipeline.SparseDataDistUtil(
        model, streams.data_dist, prefetch_stream=streams.prefetch, streams=streams
    )
    stages = [
        sdd.start_sparse_data_dist_stage(),
        pipeline.PipelineStage("prefetch", sdd.prefetch, stream=streams.prefetch),
    ]
    pipe = pipeline.StagedTrainPipeline(stages, streams=streams)
    it = iter(user_models.batches(3, rank))
    with mock.patch("pipeline.stages.prefetch.prefetch_does_work", lambda module: True):
        while (batch := pipe.progress(it)) is not None:
            opt.zero_grad()
            torch.sum(model(batch)[0]).backward()
            opt.step()
    sdd.detach()
    return told


def test_prefetch_stage_tells_the_modules_the_callers_stream(pool):
    for rank, told in enumerate(pool.run(_forward_stream_case, timeout=TIMEOUT)):
        assert told and set(told) == {"default"}, f"rank {rank}: forward_stream given to prefetch(): {told}"


@pytest.mark.parametrize(
    ("extra", "reference"),
    [("prefetch", "the plain loop"), ("lookup", "the loop that looks batch i+1 up before i's update")],
)
def test_staged_extra_stage_equals_its_reference(pool, extra, reference):
    for rank, r in enumerate(pool.run(_case, extra, timeout=TIMEOUT)):
        assert r["not_pipelined"] == [], f"{extra}: rank {rank}: modules left unpipelined: {r}"
        assert r["count"] == STEPS and r["stopped"], (
            f"{extra}: rank {rank}: {r['count']} outputs, then no end"
        )
        assert r["outputs"], f"{extra}: rank {rank}: per-step outputs differ from {reference}"
        assert r["params"], f"{extra}: rank {rank}: final parameters differ from {reference}"
        assert r["twin_differs"], f"{extra}: rank {rank}: the negative twin matches, so the check cannot fail"


def test_lookup_stream_without_its_stage_is_refused(pool):
    for message in pool.run(_missing_stage_case, timeout=TIMEOUT):
        assert "stage did not run" in message, f"a lookup stream with no lookup stage ran: {message}"


def test_prefetch_and_lookup_streams_together_are_refused():
    import torch

    import pipeline

    with pytest.raises(ValueError, match="not both"):
        pipeline.SparseDataDistUtil(
            torch.nn.Linear(2, 2),
            None,
            prefetch_stream=torch.Stream("cpu"),
            embedding_lookup_stream=torch.Stream("cpu"),
        )
    with pytest.raises(ValueError, match="embedding_lookup_stream"):
        pipeline.SparseDataDistUtil(torch.nn.Linear(2, 2)).start_embedding_lookup_stage()
