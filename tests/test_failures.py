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


def _train_until_error(rank: int, fail, at: int = FAIL_AT, **options) -> dict:
    """Train 20 batches; at forward call `at`, `fail(rank)` runs first. What ended the rank (and,
    for an error, the type of the error it was raised from)."""
    import torch

    import pipeline
    from tests import models

    model, opt = models.build("dlrm", "table_wise")
    calls = 0

    def forward(batch):
        nonlocal calls
        calls += 1
        if calls == at:
            fail(rank)
        return model(batch)

    pipe = getattr(pipeline, PIPE)(model, opt, torch.device("cpu"), custom_model_fwd=forward, **options)
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
    pipe = getattr(pipeline, PIPE)(model, opt, torch.device("cpu"), peer_timeout=timedelta(seconds=seconds))
    first = models.run_to_end(pipe, iter(models.batches("dlrm", 3, rank)))  # the vote group exists
    if rank == 1:
        time.sleep(3 * seconds + 6)  # neither votes on the next iterator nor fails
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
    # failed by its own timeout (2 s), well before the silent peer woke up (12 s)
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
