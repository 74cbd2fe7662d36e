"""The default schedule's watch on real gloo ranks, where a maintainer would doubt it: the splits
wait counted in its figure where statuses ride, its own process group made like the job's and
destroyed when the schedule goes back, a restored decision that cannot split the ranks (at 2 and 3
ranks, and at another world size), and settings that differ between ranks refused on every rank."""

from __future__ import annotations

import pytest

from tests.harness import pytest_timeout, run_ranks

KIND, SHARDING, STEPS = "nested", "table_wise", 30
TIMEOUT = 150
pytestmark = [pytest.mark.slow, pytest.mark.timeout(pytest_timeout(TIMEOUT))]

QUIET = {"threshold": 0.99}
"""A watch that never moves by itself on a test model (its share never reaches 99 %)."""


def _pipe(rank: int, watch, **kwargs):
    import torch

    from pipeline import InputDistOptions, TrainPipelineSparseDist
    from tests import models

    ref, ref_opt = models.build(KIND, SHARDING)
    model, opt = models.build(KIND, SHARDING)
    pipe = TrainPipelineSparseDist(
        model, opt, torch.device("cpu"), input_dist=InputDistOptions(watch=watch), **kwargs
    )
    data = models.batches(KIND, STEPS, rank, seed=5)
    return pipe, data, (ref, ref_opt, model)


def _bit_for_bit(run, data, got) -> bool:
    from tests import models

    ref, ref_opt, model = run
    expected = models.plain_loop(ref, ref_opt, data)
    return (
        len(got) == len(data)
        and models.bitwise_equal(expected, got)
        and models.bitwise_equal(ref.state_dict(), model.state_dict())
    )


# -- the figure counts the splits wait where statuses ride ---------------------------------------


def _splits_wait_counted(rank: int, world_size: int, clocked: bool) -> dict:
    import statistics
    import time

    from pipeline import ScheduleWatch
    from pipeline.stages.input_dist import InputDist
    from tests import models

    if not clocked:  # the twin: the splits wait without the clock around it, as it was
        InputDist.wait_splits = lambda self, ctx, lane=None: self._wait_splits(ctx, lane)

    class Recording(ScheduleWatch):
        """Moves to early at once (a share of 90 %) and records, while it verifies there, the time
        each step blocked in the input all-to-alls' waits (early waits the splits before forward,
        so a peer that issues them late is waited for there, not in forward's output all-to-all)."""

        def _share(self):
            return 0.9 if len(self._samples) >= self.window else None

        def _parts(self):
            parts = super()._parts()
            if self.mode == "early":
                self.seen.append(parts[0])
            return parts

    watch = Recording(window=3, warmup=0, settle=0, verify=20)
    watch.seen = []
    pipe, data, _ = _pipe(rank, watch)
    if rank == 1:  # rank 1 issues each next batch's splits all-to-all 150 ms late
        start_next = pipe._input_dist.start_next

        def late(lane):
            time.sleep(0.15)
            return start_next(lane)

        pipe._input_dist.start_next = late
    models.run_to_end(pipe, iter(data))
    rides = pipe._ranks.carrying
    return {"waited": statistics.median(watch.seen[2:]), "early": len(watch.seen), "rides": rides}


@pytest.mark.parametrize("clocked", [True, False], ids=["clocked", "twin-unclocked"])
def test_a_riding_batchs_splits_wait_lands_in_the_figure(clocked):
    rank0 = run_ranks(_splits_wait_counted, 2, args=(clocked,), timeout=TIMEOUT)[0]
    assert rank0["rides"] and rank0["early"] >= 10, f"the scenario tests nothing: {rank0}"
    if clocked:
        assert rank0["waited"] > 0.08, rank0
    else:  # without the clock around the splits wait, rank 1's lateness is not seen
        assert rank0["waited"] < 0.05, rank0


# -- the group: made like the job's, destroyed when the schedule goes back -------------------------


def _own_group(rank: int, world_size: int, like_the_job: bool) -> dict:
    import itertools

    import torch
    import torch.distributed as dist

    from pipeline import ScheduleWatch
    from pipeline.stages import schedule as groups
    from rewrite import kjt_all_to_alls
    from tests import models

    if not like_the_job:  # the twin: a group made as before, with torch's defaults
        groups.made_like = lambda pg: {"backend": dist.get_backend(pg), "timeout": None}

    class Moves(ScheduleWatch):
        """Publishes a share of 90 % (it moves to early); each step as long as before (it goes back)."""

        def _share(self):
            return 0.9 if len(self._samples) >= self.window else None

    counter = itertools.count()
    watch = Moves(window=3, verify=3, warmup=0, settle=0, clock=lambda: float(next(counter)))
    pipe, data, run = _pipe(rank, watch)
    it, ran, timeouts = iter(data), [], []
    got = []
    for _ in range(STEPS):
        got.append(pipe.progress(it))
        ran.append(pipe.input_dist_schedule)
        a2a = next(a for pm in pipe._input_dist.modules for a in kjt_all_to_alls(pm.module))
        timeouts.append(a2a._pg._get_backend(torch.device("cpu")).options._timeout.total_seconds())
    got += models.run_to_end(pipe, it)
    made = [own for _, own in pipe._input_dist._groups._made]
    return {
        "ran": ran,
        "timeouts": timeouts,
        "notes": [n for n in pipe.rewrite_report.notes if "process group" in n],
        "left": len(made),
        "equal": _bit_for_bit(run, data, got),
    }


@pytest.mark.parametrize("like_the_job", [True, False], ids=["like-the-job", "twin-torch-defaults"])
def test_the_own_group_takes_the_jobs_timeout_and_is_destroyed_when_the_schedule_goes_back(like_the_job):
    ranks = run_ranks(_own_group, 2, args=(like_the_job,), timeout=TIMEOUT, pg_timeout=123)
    for r in ranks:
        assert "early" in r["ran"] and r["ran"][-1] == "late", r["ran"]
        on_own = [t for t, s in zip(r["timeouts"], r["ran"], strict=True) if s == "early"]
        if like_the_job:
            assert on_own and all(t == 123 for t in on_own), r["timeouts"]
            assert r["left"] == 0 and any("destroyed" in n for n in r["notes"]), r["notes"]
            assert any("made a gloo process group" in n and "0:02:03" in n for n in r["notes"]), r["notes"]
        else:
            assert any(t != 123 for t in on_own), r["timeouts"]
        assert r["equal"], "not bit for bit across the switch and back"


# -- a restored decision cannot split the ranks ----------------------------------------------------


def _restored(rank: int, world_size: int, loads: tuple[bool, ...], saved_world: int) -> dict:
    from pipeline import ScheduleWatch
    from tests import models

    watch = ScheduleWatch(**QUIET)
    pipe, data, run = _pipe(rank, watch)
    if loads[rank]:
        decision = [(40, "kept early: the steps after were faster")]
        state = {"phase": "kept", "mode": "early", "decisions": decision, "world_size": saved_world}
        pipe.tuner.load_state_dict(state)
    ran: list[str] = []
    got = models.run_to_end(pipe, iter(data), schedules=ran)
    return {"ran": ran, "reason": watch.reason, "equal": _bit_for_bit(run, data, got)}


@pytest.mark.parametrize(
    ("loads", "saved_world", "taken"),
    [
        ((True, False), 2, False),  # only rank 0's checkpoint held a decision
        ((True, True), 2, True),
        ((False, True, True), 3, False),
        ((True, True, True), 3, True),
        ((True, True, True), 2, False),  # an elastic restart at 3 ranks of a job decided at 2
    ],
    ids=["2-one-loads", "2-all-load", "3-two-load", "3-all-load", "saved-at-2-run-at-3"],
)
def test_a_restored_decision_is_taken_by_every_rank_or_by_none(loads, saved_world, taken):
    ranks = run_ranks(_restored, len(loads), args=(loads, saved_world), timeout=TIMEOUT)
    assert all(r["ran"] == ranks[0]["ran"] for r in ranks), [r["ran"] for r in ranks]
    for r in ranks:
        assert r["equal"], "not bit for bit"
        assert ("early" in r["ran"]) is taken, (r["ran"], r["reason"])
        assert r["ran"][0] == "late", "a restored decision took effect before the ranks agreed on it"


# -- settings that differ are refused on every rank ------------------------------------------------


def _settings_differ(rank: int, world_size: int) -> str:
    from pipeline import ScheduleWatch
    from pipeline.ranks import RewriteMismatchError
    from tests import models

    pipe, data, _ = _pipe(rank, ScheduleWatch(threshold=0.5 if rank == 0 else 0.6))
    try:
        models.run_to_end(pipe, iter(data))
    except RewriteMismatchError as e:
        return str(e)
    return "no error"


def test_watch_settings_that_differ_between_ranks_raise_on_every_rank():
    said = run_ranks(_settings_differ, 2, timeout=TIMEOUT)
    for text in said:
        assert "watch settings" in text and "threshold=0.6" in text and "same ScheduleWatch" in text, text


# -- pinned for the true reason: NCCL by the groups' config, a group that cannot be copied, nothing
#    pipelined -------------------------------------------------------------------------------------


def _pinned_because(rank: int, world_size: int, case: str, twin: bool) -> dict:
    """The default schedule on a model where the watch has nothing to try: `case` "nccl" (the input
    all-to-alls' group runs NCCL for the batch's device: `backend_on` says so), "uncopyable" (a
    group like theirs cannot be made: `made_like` raises) or "nothing" (the only sharded module is
    not pipelined: explicit paths, none given). `twin`: the reason a no-module model got before."""
    from unittest import mock

    from pipeline import RewriteOptions, ScheduleWatch
    from pipeline.ranks import riding
    from pipeline.stages import input_dist
    from pipeline.stages import schedule as groups
    from tests import models

    patches = {
        "nccl": mock.patch.object(input_dist, "backend_on", lambda pg, device: "nccl"),
        "uncopyable": mock.patch.object(
            groups, "made_like", mock.Mock(side_effect=AttributeError("options"))
        ),
        "nothing": mock.patch.object(
            riding, "NOTHING_PIPELINED", riding.NO_FULL_GROUP if twin else riding.NOTHING_PIPELINED
        ),
    }
    options = {"rewrite": RewriteOptions(method="explicit")} if case == "nothing" else {}
    with patches[case]:
        pipe, data, run = _pipe(rank, ScheduleWatch(), **options)
        got = models.run_to_end(pipe, iter(data))
    return {
        "reason": pipe.tuner.reason,
        "phase": pipe.tuner.phase.value,
        "equal": _bit_for_bit(run, data, got),
    }


@pytest.mark.parametrize(
    ("case", "twin", "said"),
    [
        ("nccl", False, "has not been measured on NCCL"),
        ("uncopyable", False, "cannot be made here (AttributeError: options)"),
        ("nothing", False, "no sharded module is pipelined"),
        ("nothing", True, "spans every rank"),
    ],
    ids=["nccl", "uncopyable", "nothing-pipelined", "twin-nothing-pipelined-as-2d"],
)
def test_the_watch_is_pinned_for_its_true_reason(case, twin, said):
    for rank, r in enumerate(run_ranks(_pinned_because, 2, args=(case, twin), timeout=TIMEOUT)):
        assert r["phase"] == "pinned" and said in r["reason"], f"rank {rank}: {r}"
        assert r["equal"], f"rank {rank}: not bit for bit"


def test_the_backend_of_a_group_is_read_for_the_batchs_device(monkeypatch):
    """A group made with one backend uses it for every device; a mixed one names one per device
    (`init_process_group("cpu:gloo,cuda:nccl")`, or with no backend where CUDA is there)."""
    import torch
    import torch.distributed as dist

    from pipeline.stages.schedule import backend_on

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for config, on_cuda, on_cpu in [
        ("cpu:gloo,cuda:nccl", "nccl", "gloo"),
        ("nccl", "nccl", "nccl"),
        ("cpu:gloo,cuda:gloo", "gloo", "gloo"),
    ]:
        monkeypatch.setattr(dist, "get_backend_config", lambda group=None, c=config: c)
        assert (backend_on(None, cuda), backend_on(None, cpu)) == (on_cuda, on_cpu), config
