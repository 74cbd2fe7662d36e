"""Every pipeline class's cross-stream hand-offs, proved on CPU by `RecordingStreams`.

On 2 gloo ranks (DLRM, table-wise, distinct batches), each class runs to the end on fake streams
whose events complete one batch after they were recorded, every step inside `watch()`. The checks:
- every use of a handed-off tensor by a torch op (autograd's backward included) is on a stream that
  made it or holds it: nothing is read after the stream that took it released it;
- every object is dropped only after the event its consumer recorded after its last use completed;
- after the last batch and `wait_all()` nothing is kept, and the number kept does not grow with
  the run (its last third keeps no more than its middle third, past the fill).
Negative twins: the same run with one part of the hand-off broken on purpose fails the check, and
the error says what went wrong.
"""

from __future__ import annotations

import math

import pytest

from tests.harness import pytest_timeout

TIMEOUT = 200
STEPS = 10
LAG = 1
INFLIGHT = 4
EBC = "model.sparse_arch.embedding_bag_collection"
STASHED = ("TrainPipelineSparseDistEmbStash", "TrainPipelinePrefetchEMS")
"""Classes that lend marked embedding weights to host memory: the test model marks every table."""
"""The most batches a class has in flight (SemiSync: i to i+3), for the bound on what is kept."""
pytestmark = [pytest.mark.timeout(pytest_timeout(TIMEOUT)), pytest.mark.slow]

OPTIONS = {
    "TrainPipelineBase": {},
    "TrainPipelineSparseDist": {},
    "PrefetchTrainPipelineSparseDist": {},
    "PrefetchTrainPipelineSparseDist+stage": {},
    "TrainPipelineFusedSparseDist": {},
    "TrainPipelineSemiSync": {"start_batch": 2},
    "EvalPipelineSparseDist": {},
    "StagedTrainPipeline": {},
    "TrainPipelinePT2": {},
    "TrainPipelineSparseDistCompAutograd": {},
    "TrainPipelineSparseDistLite": {},
    "TrainPipelineSparseDistT": {},
    "TrainEvalHybridPipelineBase": {},
    "TrainPipelineSparseDistBwdOpt": {"site_fqn": EBC},
    "TrainPipelineSparseDistOptStash": {"site_fqn": EBC, "stash_min_bytes": 0},
    "TrainPipelineSparseDistEmbStash": {"site_fqn": "model.over_arch"},
    "TrainPipelinePrefetchEMS": {"site_fqn": "model.over_arch"},
    "TrainPipelinePEC": {},
    "EvalPipelineFusedSparseDist": {},
    "EvalPipelineCPUSparse": {},
    "StagedTrainPipeline+prefetch": {},
    "StagedTrainPipeline+lookup": {},
}
"""Every class a user constructs; "+stage": Prefetch made to run its prefetch stage, which the
test model's fused kernels (nothing to prefetch) would skip; Staged "+prefetch" and "+lookup":
SparseDataDistUtil's prefetch or embedding-lookup stage after its input_dist stage."""
BROKEN = {
    "no-wait": "without a wait",
    "release-at-handoff": "after its release",
    "early-drop": "before its event completed",
    "release-before-backward": "after its release",
}
"""A deliberately wrong hand-off -> what the checker must say."""
NO_BACKWARD = (
    "EvalPipelineSparseDist",
    "EvalPipelineFusedSparseDist",
    "EvalPipelineCPUSparse",
    "StagedTrainPipeline",
    "StagedTrainPipeline+prefetch",
    "StagedTrainPipeline+lookup",
)
"""Classes without a backward of their own (Staged: the caller's loop runs it)."""
SLOW = ("TrainPipelinePT2", "TrainPipelineSparseDistCompAutograd")
WATCHED = {"TrainPipelinePT2": 2, "TrainPipelineSparseDistCompAutograd": 1}
"""Steps run inside `watch()` where the later ones compile (dynamo does not trace under a
`TorchDispatchMode`): those run eager and are watched; the compiled ones are checked for their
waits, holds, releases and drops only. A broken hand-off is run watched throughout (eager, so
nothing compiles): what it must show is that the checker catches the break in that class's steps.
The compiled steps use dynamo's "eager" backend: the hand-offs are the pipeline's, whatever runs
the graphs, and tests/test_pt2.py checks the numbers under aot_eager and inductor."""


def _make(name: str, model, opt, streams):
    import torch

    import pipeline

    device = torch.device("cpu")
    if name == "TrainPipelinePT2":
        config = pipeline.TorchCompileConfig(backend="eager", compile_on_iter=2)
        return pipeline.TrainPipelinePT2(model, opt, device, config, streams=streams)
    if name == "TrainPipelineSparseDistCompAutograd":
        model._compiled_autograd_options = {"backend": "eager", "dynamic": True, "fullgraph": False}
        return pipeline.TrainPipelineSparseDistCompAutograd(model, opt, device, streams=streams)
    cls = getattr(pipeline, name.removesuffix("+stage"))
    return cls(model, opt, device, streams=streams, **OPTIONS[name])


def _build(name: str):
    import torch

    from tests import models

    if name == "TrainPipelineSparseDistCompAutograd":  # compiled autograd needs DDP's Python reducer
        with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
            return models.build("dlrm", "table_wise")
    return models.build("dlrm", "table_wise", stash=("t0", "t1", "t2") if name in STASHED else ())


def _case(rank: int, world_size: int, name: str, broken: str | None) -> dict:
    import contextlib
    from unittest import mock

    import torch

    from pipeline.pipelines.core import PipelineCore
    from tests import models

    torch._dynamo.reset()
    model, opt = _build(name)
    if name.startswith("EvalPipeline"):
        model.eval()
    data = models.batches("dlrm", STEPS, rank, seed=9)
    with contextlib.ExitStack() as patches:
        if name.endswith(("+stage", "+prefetch")):
            where = "pipelines" if name.endswith("+stage") else "stages"
            always = mock.patch(f"pipeline.{where}.prefetch.prefetch_does_work", lambda m: True)
            patches.enter_context(always)
        if broken == "release-before-backward":
            backward = PipelineCore._backward_stage

            def release_first(self, ctx, losses):
                self._streams.release(ctx)  # the batch is released before backward reads it
                backward(self, ctx, losses)

            patches.enter_context(mock.patch.object(PipelineCore, "_backward_stage", release_first))
        streams_broken = None if broken == "release-before-backward" else broken
        if name.startswith("StagedTrainPipeline"):
            return _staged(model, opt, data, streams_broken, name.partition("+")[2])
        torch._dynamo.utils.counters.clear()
        result, _ = models.recorded_run(
            lambda streams: _make(name, model, opt, streams),
            data,
            broken=streams_broken or False,
            lag=LAG,
            watched=None if broken else WATCHED.get(name),
        )
    counters = torch._dynamo.utils.counters
    result["compiled"] = counters["stats"]["unique_graphs"] + counters["compiled_autograd"]["captures"]
    return result


def _staged(model, opt, data, broken: str | None, extra: str) -> dict:
    """StagedTrainPipeline with a copy stage on memcpy, a dense transform on the prefetch stream,
    SparseDataDistUtil's stage on data_dist and, with `extra` ("prefetch" or "lookup"), its
    prefetch or embedding-lookup stage after it; the caller's loop (forward, backward, step)
    watched."""
    import torch

    import pipeline
    from tests import models, streamcheck

    streams = streamcheck.RecordingStreams(lag=LAG, broken=broken)
    extra_stream = {"prefetch": "prefetch_stream", "lookup": "embedding_lookup_stream"}
    options = {extra_stream[extra]: streams.prefetch} if extra else {}
    sdd = pipeline.SparseDataDistUtil(model, streams.data_dist, streams=streams, **options)
    stages = [
        pipeline.PipelineStage("copy", lambda b: b, stream=streams.memcpy),
        pipeline.PipelineStage("double_dense", _double_dense, stream=streams.prefetch),
        sdd.start_sparse_data_dist_stage(),
    ]
    if extra == "prefetch":
        stages.append(pipeline.PipelineStage("prefetch", sdd.prefetch, stream=streams.prefetch))
    elif extra == "lookup":
        stages.append(sdd.start_embedding_lookup_stage())
    pipe = pipeline.StagedTrainPipeline(stages, streams=streams)
    it, outputs = iter(data), 0
    while True:
        with streams.watch():
            batch = pipe.progress(it)
            if batch is None:
                break
            opt.zero_grad()
            loss, _ = model(batch)
            torch.sum(loss).backward()
            opt.step()
        outputs += 1
        assert outputs <= STEPS, "no end of data"
    sdd.detach()
    streams.wait_all()
    return models.summarize(streams, outputs)


def _double_dense(batch):
    from torchrec.datasets.utils import Batch

    return Batch(batch.dense_features * 2, batch.sparse_features, batch.labels)


def _cases(broken_too: bool) -> list:
    cases = []
    for name in OPTIONS:
        marks = [pytest.mark.slow] if name in SLOW else []
        cases.append(pytest.param(name, None, marks=marks, id=name))
        for broken in BROKEN if broken_too else ():
            if broken == "release-before-backward" and name in NO_BACKWARD:
                continue
            cases.append(pytest.param(name, broken, marks=marks, id=f"{name}-{broken}"))
    return cases


@pytest.mark.parametrize(("name", "broken"), _cases(False))
def test_handoffs_are_ordered_released_after_last_use_and_bounded(pool, name, broken):
    for rank, r in enumerate(pool.run(_case, name, broken, timeout=TIMEOUT)):
        assert r["outputs"] == STEPS, f"rank {rank}: {r['outputs']} outputs"
        assert r["error"] is None, f"rank {rank}: {r['error']}"
        assert r["drained"] is None, f"rank {rank}: {r['drained']}"
        assert r["holds"] >= STEPS, f"rank {rank}: {r['holds']} holds: the batches were not handed off"
        assert r["uses"] > 0, f"rank {rank}: no use of a handed-off tensor was seen"
        if name in WATCHED:
            assert r["compiled"] > 0, f"rank {rank}: nothing was compiled after the watched steps"
        third = len(r["kept"]) // 3  # after each release; the first third fills the pipeline
        middle, last = r["kept"][third : 2 * third], r["kept"][2 * third :]
        assert max(last) <= max(middle), f"rank {rank}: what is kept grows with the run: {r['kept']}"
        per_batch = math.ceil(r["holds"] / STEPS)
        bound = per_batch * (INFLIGHT + LAG + 1)
        assert r["peak"] <= bound, f"rank {rank}: {r['peak']} objects kept at once, above {bound}"


@pytest.mark.parametrize(("name", "broken"), [c for c in _cases(True) if c.values[1] is not None])
def test_a_broken_handoff_is_caught(pool, name, broken):
    for rank, r in enumerate(pool.run(_case, name, broken, timeout=TIMEOUT)):
        assert r["error"] is not None, f"rank {rank}: {broken} was not caught"
        assert BROKEN[broken] in r["error"], f"rank {rank}: {broken} caught as: {r['error']}"


COPIED_AHEAD = (
    "TrainPipelineBase",
    "TrainPipelineSparseDist",
    "TrainPipelineFusedSparseDist",
    "TrainPipelineSemiSync",
)
"""Classes whose next batch is copied in the step: where that copy finds memory to reuse."""


def _completed_at_copies(rank: int, world_size: int, name: str) -> list[int]:
    """With events that complete as soon as they are recorded (a GPU that keeps up with the host),
    the objects released and not yet dropped when each copy stage starts: memory the allocator
    would reuse under record_stream, and the keep-alive would still hold."""
    from tests import models, streamcheck

    model, opt = _build(name)
    streams = streamcheck.RecordingStreams(lag=0)
    pending: list[int] = []
    started = streams.stage_started

    def stage_started(stage: str) -> None:
        if stage == "copy":
            kinds = [entry[0] for entry in streams.log]
            pending.append(kinds.count("release") - kinds.count("drop"))
        started(stage)

    streams.stage_started = stage_started
    pipe = _make(name, model, opt, streams)
    models.run_to_end(pipe, iter(models.batches("dlrm", STEPS, rank, seed=9)))
    return pending


@pytest.mark.parametrize("name", COPIED_AHEAD)
def test_what_completed_is_dropped_before_the_next_copy(pool, name):
    for rank, pending in enumerate(pool.run(_completed_at_copies, name, timeout=TIMEOUT)):
        assert len(pending) >= STEPS - 1, f"rank {rank}: {len(pending)} copies seen"
        assert not any(pending), f"rank {rank}: released objects still held at each copy: {pending}"
