"""A rank that fails, and what its peers do, per option (docs/pipeline.md, "When a rank fails").

- Every rank raising at the same step: each re-raises its own error and the process group stays
  usable, as long as the others raise within `failure_grace`; later than that, the first rank takes
  it for an asymmetric failure and destroys its groups.
- `abort_on_error=False`: the failed rank leaves its groups alone; its peer waits until the groups
  close (here: until the failed rank closes them itself, seconds later).
- `peer_timeout`: a vote waits that long for a peer that neither votes nor fails, then fails.
- A peer killed outright (SIGKILL): the other rank still stops, saying no rank recorded an error.
- A StopIteration raised inside a step (a forward's stray `next()`) is such a failure, not the end
  of the data: let through, it would end that rank's loop alone.

2 gloo ranks, TrainPipelineSparseDist on the DLRM test model; every scenario that breaks a process
group runs on ranks of its own (`run_ranks`); the StopIteration's twins run in one process. At 3 and
4 ranks, the other ranks following a failure: tests/test_ranks.py.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from tests.harness import RankError, pytest_timeout, run_ranks

PIPE = "TrainPipelineSparseDist"
TIMEOUT = 90
FAIL_AT = 6  # the forward call that fails (batch 5)
pytestmark = [pytest.mark.timeout(pytest_timeout(TIMEOUT)), pytest.mark.slow]


def _train_until_error(rank: int, fail, at: int = FAIL_AT, model_out: dict | None = None, **options) -> dict:
    """Train 20 batches; at forward call `at`, `fail(rank)` runs first. What ended the rank (and,
    for an error, the type of the error it was raised from). `model_out` gets the model."""
    import torch

    import pipeline
    from tests import models

    model, opt = models.build("dlrm", "table_wise")
    if model_out is not None:
        model_out["model"] = model
    calls = 0

    def forward(batch):
        nonlocal calls
        calls += 1
        if calls == at:
            fail(rank)
        return model(batch)

    pipe = getattr(pipeline, PIPE)(
        model, opt, torch.device("cpu"), custom_model_fwd=forward, ranks=pipeline.RankOptions(**options)
    )
    it = iter(models.batches("dlrm", 20, rank))
    try:
        while True:
            pipe.progress(it)
    except StopIteration:
        return {"error": None, "at": time.time()}
    except Exception as e:  # whichever error ends the rank is the result
        cause = type(e.__cause__).__name__ if e.__cause__ is not None else None
        return {"error": f"{type(e).__name__}: {e}", "at": time.time(), "cause": cause}


def _raise_after(delays: tuple[float, ...]):
    def fail(rank: int) -> None:
        time.sleep(delays[rank])
        raise ValueError(f"bad batch on rank {rank}")

    return fail


def _every_rank_raises(rank: int, world_size: int, delays: tuple[float, ...], grace: float) -> dict:
    import torch
    import torch.distributed as dist

    result = _train_until_error(rank, _raise_after(delays), failure_grace=grace)
    result["group_alive"] = dist.is_initialized()
    if result["group_alive"] and grace > max(delays):
        t = torch.ones(1)
        dist.all_reduce(t)  # the job may go on: the group still works
        result["all_reduce"] = t.item()
    return result


def test_every_rank_raising_within_the_grace_keeps_the_process_group():
    # rank 1 raises 1 s after rank 0: within the 4 s grace, so nothing is destroyed
    results = run_ranks(_every_rank_raises, 2, timeout=TIMEOUT, args=((0.0, 1.0), 4.0))
    for rank, r in enumerate(results):
        assert r["error"] == f"ValueError: bad batch on rank {rank}", r
        assert r["group_alive"] and r["all_reduce"] == 2, r


def _interrupted(rank: int) -> None:
    raise KeyboardInterrupt  # Ctrl-C under torchrun reaches every worker


def _every_rank_interrupted(rank: int, world_size: int) -> dict:
    import torch
    import torch.distributed as dist

    try:
        _train_until_error(rank, _interrupted)
        return {"interrupted": False}
    except KeyboardInterrupt:
        t = torch.ones(1)
        dist.all_reduce(t)  # the user's handler may save a checkpoint: the group still works
        return {"interrupted": True, "all_reduce": t.item()}


def test_a_keyboard_interrupt_on_every_rank_leaves_the_process_groups_usable():
    for rank, r in enumerate(run_ranks(_every_rank_interrupted, 2, timeout=TIMEOUT)):
        assert r == {"interrupted": True, "all_reduce": 2.0}, f"rank {rank}: {r}"


def test_a_rank_raising_after_the_grace_is_taken_for_an_asymmetric_failure():
    # rank 1 raises 3 s after rank 0, whose grace is 0.5 s: rank 0 destroys its groups
    r0, r1 = run_ranks(_every_rank_raises, 2, timeout=TIMEOUT, args=((0.0, 3.0), 0.5))
    assert r0["error"] == "ValueError: bad batch on rank 0" and not r0["group_alive"], r0
    assert r1["error"] == "ValueError: bad batch on rank 1", r1


HOLD = 5.0  # seconds the failed rank keeps its groups open under abort_on_error=False


def _rank1_raises(rank: int) -> None:
    if rank == 1:
        raise ValueError("bad batch on purpose")


def _abort_off(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    start = time.time()
    result = _train_until_error(rank, _rank1_raises, abort_on_error=False)
    result["group_alive"] = dist.is_initialized()
    if rank == 1:
        result["raised_at"] = result["at"]
        time.sleep(HOLD)  # the peer must still be waiting: nothing told it
        dist.destroy_process_group()
    result["start"] = start
    return result


def test_abort_on_error_false_leaves_the_groups_and_the_peer_waits():
    r0, r1 = run_ranks(_abort_off, 2, timeout=TIMEOUT)
    assert r1["error"] == "ValueError: bad batch on purpose" and r1["group_alive"], r1
    assert r0["error"] is not None and not r0["error"].startswith("PeerFailedError"), r0
    waited = r0["at"] - r1["raised_at"]
    assert waited >= HOLD - 0.5, f"rank 0 stopped {waited:.1f} s after the failure, before its peer let go"


def _peer_timeout(rank: int, world_size: int, seconds: float) -> dict:
    import torch

    import pipeline
    from tests import models

    model, opt = models.build("dlrm", "table_wise")
    options = pipeline.RankOptions(peer_timeout=timedelta(seconds=seconds))
    pipe = getattr(pipeline, PIPE)(model, opt, torch.device("cpu"), ranks=options)
    first = models.run_to_end(pipe, iter(models.batches("dlrm", 3, rank)))  # the vote group exists
    if rank == 1:
        time.sleep(3 * seconds + 3)  # neither votes on the next iterator nor fails
        return {"first": len(first)}
    start = time.monotonic()
    try:
        pipe.progress(iter(models.batches("dlrm", 3, rank, seed=2)))
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    return {"first": len(first), "error": error, "waited": time.monotonic() - start}


def test_peer_timeout_bounds_the_wait_for_a_silent_peer():
    r0, r1 = run_ranks(_peer_timeout, 2, timeout=TIMEOUT, args=(2.0,))
    assert r0["first"] == r1["first"] == 3
    assert r0["error"] and r0["error"].startswith("PeerFailedError"), r0
    assert "no rank recorded an error" in r0["error"], r0
    # failed by its own timeout (2 s), well before the silent peer woke up (9 s)
    assert 2.0 <= r0["waited"] < 8.0, r0


def _killed(rank: int, world_size: int, stamp: str) -> dict:
    def kill(rank: int) -> None:
        if rank == 1:
            Path(stamp).write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

    return _train_until_error(rank, kill)


def test_a_peer_killed_outright_stops_the_other_rank(tmp_path):
    stamp = tmp_path / "killed_at"
    with pytest.raises(RankError, match=r"rank 1 was killed by signal SIGKILL") as info:
        run_ranks(_killed, 2, timeout=TIMEOUT, args=(str(stamp),), grace=30)
    r0 = info.value.results[0]
    assert r0["error"] and r0["error"].startswith("PeerFailedError"), r0
    assert "no rank recorded an error: a peer was probably killed or exited" in r0["error"], r0
    waited = r0["at"] - float(stamp.read_text())
    assert waited < 5.0, f"rank 0 stopped {waited:.1f} s after its peer was killed"


def _stop_iteration_in_forward(rank: int, world_size: int) -> dict:
    """Rank 1's forward raises StopIteration at its 4th call (a stray `next()` in a model)."""
    raised: dict = {}

    def stop(rank: int) -> None:
        if rank == 1:
            raised["at"] = time.time()
            raise StopIteration

    return {**_train_until_error(rank, stop, at=4), "raised_at": raised.get("at")}


def test_a_stop_iteration_inside_the_step_fails_the_rank_and_stops_its_peer():
    """Not a normal end on rank 1 (its loop would stop there while rank 0 waits in the step's
    collectives for the process group's timeout): rank 1 raises `StopIterationInStepError` from the
    StopIteration, and rank 0 stops with `PeerFailedError` soon after `failure_grace` (2 s)."""
    r0, r1 = run_ranks(_stop_iteration_in_forward, 2, timeout=TIMEOUT)
    assert r1["error"] is not None, f"rank 1 took the StopIteration for the end of its data: {r1}"
    assert r1["error"].startswith("StopIterationInStepError: a StopIteration was raised inside the step"), r1
    assert r1["cause"] == "StopIteration", r1
    assert r0["error"] and r0["error"].startswith("PeerFailedError"), r0
    assert "rank 1 raised StopIterationInStepError" in r0["error"], r0
    waited = r0["at"] - r1["raised_at"]
    assert 2.0 <= waited < 2.0 + 6.0, f"rank 0 ended {waited:.1f} s after rank 1's StopIteration"


class _StopsAt(torch.nn.Module):
    """A model whose forward raises StopIteration at call `at` (one process, no sharded module)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.linear, self.at, self.calls = torch.nn.Linear(2, 1), at, 0

    def forward(self, batch: torch.Tensor):
        self.calls += 1
        if self.calls == self.at:
            next(iter([]))  # a stray next() without a default
        out = self.linear(batch)
        return out.sum(), out.detach()


def _one_process_run() -> tuple[list, BaseException | None]:
    """TrainPipelineBase on `_StopsAt(4)` over 8 batches, as a training loop runs it: the outputs,
    and the exception that ended the loop (None: the loop took a StopIteration for the end)."""
    import pipeline

    model = _StopsAt(4)
    pipe = pipeline.TrainPipelineBase(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"))
    it, outputs = iter([torch.full((3, 2), float(i)) for i in range(8)]), []
    try:
        while True:
            outputs.append(pipe.progress(it))
    except StopIteration:
        return outputs, None
    except Exception as e:
        return outputs, e


def test_a_stop_iteration_inside_the_step_is_raised_as_an_error_in_one_process():
    import pipeline

    outputs, error = _one_process_run()
    assert isinstance(error, pipeline.StopIterationInStepError), f"after {len(outputs)} outputs: {error!r}"
    assert isinstance(error.__cause__, StopIteration) and len(outputs) == 3


def test_a_stop_iteration_let_through_would_end_the_loop_as_the_data_s_end(monkeypatch):
    """The negative twin: with the StopIteration let out of `progress()` as it was (the error's
    class patched to StopIteration itself), the same loop ends quietly after 3 of 8 batches, which
    the test above would catch."""
    from pipeline.pipelines import core

    monkeypatch.setattr(core, "StopIterationInStepError", StopIteration)
    outputs, error = _one_process_run()
    assert error is None and len(outputs) == 3, (outputs, error)


def test_a_stop_iteration_in_a_staged_pipeline_s_stage_is_an_error(monkeypatch):
    """StagedTrainPipeline ends with None; a stage's StopIteration would end a loop written as
    `for batch in iter(lambda: pipe.progress(it), None)` quietly. It is raised as the error; with
    it let through (the twin), that loop ends after one batch of six (the stage's third call runs
    on batch 3 in the step that would return batch 2)."""
    import pipeline
    from pipeline.pipelines import staged

    def runs(n: int) -> list:
        calls = []

        def stage(batch):
            calls.append(batch)
            if len(calls) == 3:
                raise StopIteration
            return batch

        pipe = pipeline.StagedTrainPipeline([pipeline.PipelineStage(name="stage", runnable=stage)])
        it = iter(range(1, n + 1))
        return list(iter(lambda: pipe.progress(it), None))

    with pytest.raises(pipeline.StopIterationInStepError) as info:
        runs(6)
    assert isinstance(info.value.__cause__, StopIteration)
    monkeypatch.setattr(staged, "StopIterationInStepError", StopIteration)
    assert runs(6) == [1], "the twin: a StopIteration let through ends the loop quietly"


def _signal(store, scope: str, rank: int):
    from pipeline.ranks.failure import FailureSignal

    signal = FailureSignal(grace=0.05, scope=scope)  # no process group: wire in a store of 2 ranks
    signal.store, signal.rank, signal.world, signal.distributed = store, rank, 2, True
    return signal


def test_a_failure_of_an_earlier_pipeline_does_not_count_in_a_later_one():
    # both ranks raised in pipeline 1 (generation 0 of its keys); pipeline 2 starts at generation 0
    # too, and must see neither that failure nor "every rank failed" from it
    import torch.distributed as dist

    from pipeline.ranks.failure import PeerFailedError

    store = dist.HashStore()
    for rank in range(2):
        _signal(store, "p1/", rank).announce(RuntimeError("bad batch on every rank"))
    assert _signal(store, "p1/", 0).all_failed()
    later = _signal(store, "p2/", 0)
    assert not later.all_failed() and later.peer_failures() == []
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as peer:  # rank 1 arrives first and waits: no stop on the stale failure
        arrived = peer.submit(_signal(store, "p2/", 1).rendezvous, "group7", timeout=5)
        time.sleep(0.05)
        later.rendezvous("group7", timeout=5)
        arrived.result()
    _signal(store, "p2/", 1).announce(ValueError("rank 1's own"))
    with pytest.raises(PeerFailedError, match="rank 1's own"):
        later.rendezvous("group8", timeout=5)


# -- a preemption: SystemExit from a SIGTERM handler ------------------------------------------------


def _preempted(rank: int, world_size: int, twin: bool, checkpoint: str) -> dict:
    """Every rank's SIGTERM handler raises SystemExit inside `progress()` (forward of batch 5), rank
    1's three seconds after rank 0's (past `failure_grace`, 2 s); then each does what a preemption
    handler does: an all_reduce and a DCP save of the model on the job's groups. `twin`: an
    interrupt taken down the failure path, as before."""
    import signal as signals

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from pipeline.pipelines.core import PipelineCore

    if twin:
        PipelineCore._interrupted = lambda self, interrupt: self._fail(interrupt)

    def handler(signum, frame):
        raise SystemExit(143)

    signals.signal(signals.SIGTERM, handler)

    def preempt(rank: int) -> None:
        time.sleep(3.0 * rank)
        os.kill(os.getpid(), signals.SIGTERM)

    result: dict = {"exit": None}
    try:
        _train_until_error(rank, preempt, model_out=result)
    except SystemExit as e:
        result["exit"] = e.code
    result["group_alive"] = dist.is_initialized()
    model = result.pop("model")
    if result["group_alive"]:
        try:
            t = torch.ones(1)
            dist.all_reduce(t)
            result["all_reduce"] = t.item()
            dcp.save({"model": model.state_dict()}, checkpoint_id=f"{checkpoint}/step")
            result["saved"] = os.path.exists(f"{checkpoint}/step/.metadata")
        except RuntimeError as e:  # the twin: the peer's groups are gone
            result["handler_error"] = str(e)
    return result


@pytest.mark.parametrize("twin", [False, True], ids=["interrupt", "twin-failure-path"])
def test_a_preemptions_system_exit_keeps_the_jobs_groups_for_its_checkpoint(twin, tmp_path):
    ranks = run_ranks(_preempted, 2, timeout=TIMEOUT, args=(twin, str(tmp_path)))
    if twin:  # taken for a failure, rank 0 destroyed its groups before rank 1's handler ran
        assert not ranks[0]["group_alive"], ranks[0]
        return
    for rank, r in enumerate(ranks):
        assert r["exit"] == 143 and r["group_alive"], f"rank {rank}: {r}"
        assert r["all_reduce"] == 2.0 and r["saved"], f"rank {rank}: {r}"


# -- a rank's own error, whatever its text -----------------------------------------------------------


def _loader_times_out(rank: int, world_size: int, twin: bool) -> dict:
    """Rank 1's dataloader raises an error whose text reads like a broken collective's. `twin`: the
    error classified by its text, as before."""
    import torch

    import pipeline
    from pipeline.ranks import failure
    from tests import models

    if twin:
        failure.from_a_collective = lambda e: (
            isinstance(e, failure.PeerFailedError)
            or any(
                m in str(e) for m in ("Connection closed by peer", "Connection reset by peer", "Timed out")
            )
        )

    def loader():
        for i, batch in enumerate(models.batches("dlrm", 20, rank)):
            if rank == 1 and i == 6:
                raise RuntimeError("feature service: Timed out after 5 s")
            yield batch

    model, opt = models.build("dlrm", "table_wise")
    pipe = pipeline.TrainPipelineSparseDist(model, opt, torch.device("cpu"))
    try:
        models.run_to_end(pipe, loader())
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "notes": list(getattr(e, "__notes__", []))}
    return {"error": None}


@pytest.mark.parametrize("twin", [False, True], ids=["own-error", "twin-by-text"])
def test_a_ranks_own_error_that_reads_like_a_timeout_is_its_own(twin):
    r0, r1 = run_ranks(_loader_times_out, 2, timeout=TIMEOUT, args=(twin,))
    if twin:
        assert r1["error"].startswith("PeerFailedError"), r1  # blamed on a peer, its text lost
        return
    assert r1["error"] == "RuntimeError: feature service: Timed out after 5 s", r1
    assert any("destroyed its process groups" in n and "abort_on_error=False" in n for n in r1["notes"]), r1
    assert r0["error"].startswith("PeerFailedError"), r0
    assert "rank 1 raised RuntimeError: feature service: Timed out after 5 s" in r0["error"], r0


# -- what the library makes, it releases ----------------------------------------------------------


def _made_and_released(rank: int, world_size: int, twin: bool) -> dict:
    """Three pipelines (our SparseDist forced to the early schedule, which makes a process group of
    its own, and Prefetch, whose prefetch stream is a thread) built, run and closed; then a fourth
    dropped without close(). What is left of what they made: torch's process groups, the keys
    they added to the job's store, their threads. `twin`: close() without destroying the groups."""
    import gc
    import threading

    import torch
    import torch.distributed as dist

    import pipeline
    from pipeline.ranks import failure
    from pipeline.ranks.protocol import OwnedGroups
    from tests import models

    if twin:
        OwnedGroups.destroy_all = lambda self: None
    store = failure.job_store()
    added: set[str] = set()

    class Recording:
        """The job's store, recording the keys the pipeline writes."""

        def __getattr__(self, name):
            return getattr(store, name)

        def add(self, key, value):
            added.add(key)
            return store.add(key, value)

        def set(self, key, value):
            added.add(key)
            return store.set(key, value)

    failure.job_store = lambda: Recording()
    groups_before = len(dist.distributed_c10d._world.pg_map)

    def run(name: str, close: bool) -> None:
        model, opt = models.build("dlrm", "table_wise")
        options = pipeline.InputDistOptions(schedule="early")
        pipe = getattr(pipeline, name)(model, opt, torch.device("cpu"), input_dist=options)
        models.run_to_end(pipe, iter(models.batches("dlrm", 6, rank)))
        if close:
            pipe.close()

    for name in ("TrainPipelineSparseDist", "PrefetchTrainPipelineSparseDist", "TrainPipelineSparseDist"):
        run(name, close=True)
    after_close = len(dist.distributed_c10d._world.pg_map)
    run("PrefetchTrainPipelineSparseDist", close=False)
    gc.collect()
    dist.barrier()  # every rank has checked its keys out of the store
    return {
        "groups": (groups_before, after_close, len(dist.distributed_c10d._world.pg_map)),
        "keys_added": sorted(added),
        "keys_left": sorted(k for k in added if store.check([k])),
        "threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("pipeline-")),
    }


@pytest.mark.parametrize("twin", [False, True], ids=["closed", "twin-groups-kept"])
def test_what_three_pipelines_made_is_released_by_close_and_garbage_collection(twin):
    for rank, r in enumerate(run_ranks(_made_and_released, 2, timeout=TIMEOUT, args=(twin,))):
        before, closed, collected = r["groups"]
        if twin:
            assert closed > before, f"rank {rank}: the twin should leave groups: {r}"
            continue
        assert before == closed == collected, f"rank {rank}: torch's group map {r['groups']}"
        assert r["keys_added"] and not r["keys_left"], f"rank {rank}: {r}"
        assert not r["threads"], f"rank {rank}: threads left: {r['threads']}"


def test_a_job_whose_default_group_has_no_store_is_told_what_it_loses(monkeypatch):
    """Where the default group's store cannot be had, failures are not signalled: said once, as a
    warning, not silently."""
    import torch.distributed as dist

    from pipeline.ranks import failure

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)

    def no_store():
        raise RuntimeError("no default store")

    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", no_store)
    with pytest.warns(RuntimeWarning, match="cannot tell its peers why") as said:
        assert failure.job_store() is None
    assert "no default store" in str(said[0].message)


def _dropped_then_forked(rank: int, world_size: int, twin: bool) -> dict:
    """A pipeline dropped (unreachable, not yet collected) when the process forks, as a DataLoader
    worker forks: the child collects the parent's garbage, which runs the pipeline's finalizer there.
    It must do nothing in the child (the groups' connections and the threads are the parent's).
    `twin`: the child takes itself for the parent. What the child did, and whether the parent's
    groups still work."""
    import gc
    import os
    import time

    import torch
    import torch.distributed as dist

    import pipeline
    from tests import models

    model, opt = models.build("dlrm", "table_wise")
    pipe = pipeline.PrefetchTrainPipelineSparseDist(
        model, opt, torch.device("cpu"), input_dist=pipeline.InputDistOptions(schedule="early")
    )
    models.run_to_end(pipe, iter(models.batches("dlrm", 6, rank)))
    gc.collect()
    gc.disable()
    pipe.itself = pipe  # a cycle: only the collector frees it
    del pipe
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        if twin:
            os.getpid = lambda: parent
        gc.collect()
        os._exit(0)
    deadline, status = time.monotonic() + 8, None  # the child exits in well under a second
    while time.monotonic() < deadline:
        done, code = os.waitpid(child, os.WNOHANG)
        if done:
            status = os.waitstatus_to_exitcode(code)
            break
        time.sleep(0.05)
    if status is None:
        os.kill(child, 9)
        os.waitpid(child, 0)
    gc.enable()
    gc.collect()
    works = torch.ones(1)
    dist.all_reduce(works)
    return {"child": status, "all_reduce": works.item()}


@pytest.mark.parametrize("twin", [False, True], ids=["forked", "twin-child-as-parent"])
def test_a_dropped_pipeline_collected_in_a_forked_child_leaves_the_child_alone(twin):
    for rank, r in enumerate(run_ranks(_dropped_then_forked, 2, timeout=TIMEOUT, args=(twin,))):
        assert r["all_reduce"] == 2.0, f"rank {rank}: {r}"
        if twin:
            assert r["child"] != 0, f"rank {rank}: the twin's child should hang or fail: {r}"
        else:
            assert r["child"] == 0, f"rank {rank}: the forked child hung or failed: {r}"
