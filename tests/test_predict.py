"""benchmarks.predictor: the simulator on hand-computed cases, each pipeline's program on stage costs
chosen so that the answer is known, the loads per rank, the link, the result table, and the dense
timing leaving the model as it was. One process, no process group."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from torch import nn

from benchmarks.predictor.costs import Collective, StageCosts, rank_loads
from benchmarks.predictor.dense import time_dense
from benchmarks.predictor.link import Link, alltoall_seconds, parse_link
from benchmarks.predictor.programs import program, run_pipeline
from benchmarks.predictor.simulate import Task, attribute, simulate
from benchmarks.predictor.workload import Feature, Table, Workload

NONE = Collective(host=0.0, latency=0.0, wire=0.0)
LOOPBACK = Link(name="loopback", bandwidth=1e9, latency=1e-4, cpu_per_byte=1e-9)


def costs(**given: float | Collective) -> StageCosts:
    """Stage costs of zero but those given (seconds)."""
    fields = {f.name: (NONE if f.type == "Collective" else 0.0) for f in dataclasses.fields(StageCosts)}
    return StageCosts(**{**fields, **given})


def wire(seconds: float) -> Collective:
    return Collective(host=0.0, latency=0.0, wire=seconds)


# -- the simulator --------------------------------------------------------------------------------


def test_a_lane_runs_its_tasks_one_after_the_other():
    run = simulate([Task(("a", 0), "host", 1.0), Task(("b", 0), "host", 2.0)], {"cpu": 4})
    assert run.end[("b", 0)] == pytest.approx(3.0), "one lane: the second task starts when the first ends"


def test_an_async_collective_overlaps_the_host_until_it_is_waited_for():
    tasks = [
        Task(("issue", 0), "host", 1.0),
        Task(("a2a", 0), "group", 3.0, uses=(("link", 1.0),), after=(("issue", 0),)),
        Task(("compute", 0), "host", 2.0),
        Task(("use", 0), "host", 0.5, after=(("a2a", 0),)),
    ]
    run = simulate(tasks, {"cpu": 1})
    assert run.end[("compute", 0)] == pytest.approx(3.0), "compute runs while the all-to-all is on the link"
    assert run.start[("use", 0)] == pytest.approx(4.0), "the waiting task starts when the all-to-all ends"
    shares = attribute(run, "host", 0.0, 4.5)
    assert shares == pytest.approx({"issue": 1.0, "compute": 2.0, "a2a": 1.0, "use": 0.5}), (
        "wait charged to a2a"
    )


def test_tasks_that_ask_for_more_of_a_resource_than_there_is_slow_down_in_proportion():
    two = [Task(("x", 0), "one", 1.0), Task(("y", 0), "two", 1.0)]
    assert simulate(two, {"cpu": 1}).end[("y", 0)] == pytest.approx(2.0), "one core: both at half speed"
    assert simulate(two, {"cpu": 2}).end[("y", 0)] == pytest.approx(1.0), "two cores: both at full speed"
    free = [Task(("x", 0), "one", 1.0), Task(("lat", 0), "two", 1.0, uses=())]
    assert simulate(free, {"cpu": 1}).end[("lat", 0)] == pytest.approx(1.0), "a latency holds no core"


def test_a_process_group_runs_collectives_in_issue_order_and_the_wait_is_charged_to_the_first():
    tasks = [
        Task(("big", 0), "world", 5.0, uses=(("link", 1.0),)),
        Task(("small", 0), "world", 0.5, uses=(("link", 1.0),)),
        Task(("backward", 0), "host", 1.0),
        Task(("step", 0), "host", 1.0, after=(("small", 0),)),
    ]
    run = simulate(tasks, {"cpu": 1})
    assert run.start[("small", 0)] == pytest.approx(5.0), "the small collective queues behind the big one"
    assert attribute(run, "host", 0.0, 6.5)["big"] == pytest.approx(4.0), "the queueing is charged to big"


def test_a_cycle_is_reported_instead_of_hanging():
    with pytest.raises(ValueError, match="never run"):
        simulate(
            [Task(("a", 0), "x", 1.0, after=(("b", 0),)), Task(("b", 0), "y", 1.0, after=(("a", 0),))], {}
        )
    with pytest.raises(ValueError, match="not a task"):
        simulate([Task(("a", 0), "x", 1.0, after=(("z", 0),))], {})


# -- the pipelines' programs ----------------------------------------------------------------------

COMPUTE = {"lookup_fwd": 0.002, "dense_fwd": 0.003, "dense_bwd": 0.003, "lookup_bwd": 0.002}  # 10 ms


# Fused looks batch i up first in its step, before the input_dist of i+1 starts: 2 ms not hidden
@pytest.mark.parametrize(
    ("pipeline", "expected"),
    [("sparse-dist", 0.030), ("prefetch", 0.030), ("fused", 0.032), ("semi-sync", 0.030)],
)
def test_a_network_bound_pipeline_hides_compute_behind_the_values_all_to_all(pipeline, expected):
    c = costs(**COMPUTE, values=wire(0.030))
    assert run_pipeline(pipeline, "early", c, cores=2).step == pytest.approx(expected, rel=1e-6), (
        f"{pipeline}, early schedule: the step is the all-to-all's 30 ms, compute hidden"
    )
    assert run_pipeline("base", "late", c, cores=2).step == pytest.approx(0.040, rel=1e-6), (
        "Base cannot hide input_dist: compute plus the all-to-all"
    )


@pytest.mark.parametrize("pipeline", ["sparse-dist", "prefetch", "fused", "semi-sync"])
def test_a_compute_bound_pipeline_is_bound_by_compute(pipeline):
    c = costs(**{k: 3 * v for k, v in COMPUTE.items()}, values=wire(0.010))
    out = run_pipeline(pipeline, "early", c, cores=2)
    assert out.step == pytest.approx(0.030, rel=1e-6), f"{pipeline}: 30 ms of compute, the all-to-all hidden"
    assert out.critical in ("dense fwd", "dense bwd", "lookup fwd", "lookup bwd"), (
        f"{pipeline}: {out.critical}"
    )
    assert "values a2a" not in out.shares, f"{pipeline}: the training thread never waits for the values"


def test_late_on_the_shared_group_puts_the_values_all_to_all_in_front_of_backward():
    # values issued after forward on torchrec's group: the gradient all-to-all of backward queues
    # behind it; on a group of their own it does not (the fix measured in docs/benchmarks.md)
    c = costs(**COMPUTE, values=wire(0.030), output_bwd=wire(0.001))
    late = run_pipeline("sparse-dist", "late", c, cores=2)
    own = run_pipeline("sparse-dist", "late-own", c, cores=2)
    # late: 5 ms of forward, the values issued, 3 ms of dense backward; the gradient a2a waits for
    # the rest of the 30 ms transfer, then takes 1 ms, then 2 ms of the embeddings' backward
    assert late.step == pytest.approx(0.005 + 0.030 + 0.001 + 0.002, rel=1e-6), (
        "backward waits for the transfer"
    )
    assert late.critical == "values a2a"
    # own group: backward runs beside the transfer; forward of the next batch waits for its ids,
    # and the next transfer starts after that forward: 30 + 5 ms, and 1 ms more since the gradient
    # a2a shares the link with the transfer meanwhile
    assert own.step == pytest.approx(0.036, rel=1e-6), "own group: the transfer overlaps backward"
    assert run_pipeline("sparse-dist", "early", c, cores=2).step == pytest.approx(0.031, rel=1e-6), (
        "early splits: the transfer starts before forward and overlaps all of the step (and shares the link)"
    )


def test_on_one_core_a_transfer_that_needs_the_cpu_competes_with_compute():
    loopback = dataclasses.replace(costs(**COMPUTE, values=wire(0.010)), cpu_share=1.0)
    assert run_pipeline("sparse-dist", "early", loopback, cores=1).step == pytest.approx(0.020, rel=1e-6), (
        "one core: the copies of a loopback transfer and compute take turns"
    )
    assert run_pipeline("sparse-dist", "early", loopback, cores=2).step == pytest.approx(0.010, rel=1e-6), (
        "negative twin: with a core to spare they overlap"
    )


def test_memory_in_flight_follows_the_stage_table():
    c = costs(batch_bytes=100.0, values_bytes=10.0, pooled_bytes=1.0)
    batches = {p: run_pipeline(p, "late", c, cores=1).batches for p in ("base", "sparse-dist", "semi-sync")}
    assert batches == {"base": 2, "sparse-dist": 3, "semi-sync": 4}, "batches i..i+1, i+2, i+3 in flight"
    assert run_pipeline("semi-sync", "late", c, cores=1).inflight_bytes == 4 * 100 + 2 * 10 + 1


def test_every_step_issues_the_stages_of_its_class_once_per_batch():
    tasks = program("fused", "late", costs(), steps=4)
    names = [t.key for t in tasks]
    assert len(names) == len(set(names)), "one task per stage and batch"
    assert ("lookup fwd", 3) in names and ("values a2a", 4) in names, "lookup of i, input_dist of i+1"
    with pytest.raises(ValueError, match="unknown pipeline"):
        program("sideways", "late", costs())


# -- loads, links, the table ----------------------------------------------------------------------


def workload(world: int, *, sharding: str = "table_wise") -> Workload:
    tables = tuple(
        Table(
            name=f"t{i}",
            rows=100,
            dim=4,
            features=(f"f{i}",),
            sharding=sharding,
            kernel="fused",
            ranks=(i % world,),
            shard_dims=(4,),
        )
        for i in range(4)
    )
    features = tuple(Feature(name=f"f{i}", ids_per_sample=2.0) for i in range(4))
    return Workload(
        world_size=world,
        batch_size=10,
        tables=tables,
        features=features,
        dense_layers=(),
        dense_ops=5,
        dense_params=100,
        dense_tensors=2,
        sharded_modules=1,
    )


def test_table_wise_loads_per_rank():
    loads = rank_loads(workload(2))
    # rank 0 holds t0 and t2: it looks up 2 ranks x 10 samples x 2 ids for each
    assert loads[0].lookup_ids == 2 * 2 * 10 * 2
    # it sends rank 1 its ids of f1 and f3 (10 x 2 ids of 8 bytes, 10 lengths of 4) and gets as many
    assert loads[0].values_out == loads[0].values_in == 2 * (10 * 2 * 8 + 10 * 4)
    # and sends back one pooled row of 4 floats per sample for each of its 2 tables
    assert loads[0].pooled_out == 2 * 10 * 4 * 4
    assert rank_loads(workload(1))[0].values_out == 0, "one rank: nothing crosses a link"


def test_tables_are_placed_again_on_more_ranks_and_the_busiest_rank_grows():
    w8 = workload(2).at_world_size(8)
    assert sorted(r for t in w8.tables for r in t.ranks) == [0, 1, 2, 3], "4 tables on 4 of 8 ranks"
    assert max(x.lookup_ids for x in rank_loads(w8)) == 8 * 10 * 2, "one table's ids from all 8 ranks"
    rw = workload(2, sharding="row_wise").at_world_size(8)
    assert max(x.lookup_ids for x in rank_loads(rw)) == pytest.approx(4 * 10 * 2), "row-wise spreads the ids"


def test_links_by_name_and_the_all_to_all_cost():
    link = parse_link("1gbit", loopback=LOOPBACK)
    assert link.bandwidth == 125e6 and link.latency == LOOPBACK.latency
    assert parse_link("25gbit:10us", loopback=LOOPBACK).latency == pytest.approx(1e-5)
    with pytest.raises(ValueError, match="rate:latency"):
        parse_link("fast", loopback=LOOPBACK)
    # 3 peers of 1 MB each: the call, 2 extra messages, then 3 MB at 125 MB/s after one latency
    seconds = alltoall_seconds(link, call=1e-3, peers=3, bytes_per_peer=1e6)
    assert seconds == pytest.approx(1e-3 + 3 * 1e-4 + 3e6 / 125e6)
    curved = dataclasses.replace(link, curve=((0, 0.001), (1000, 0.002), (3000, 0.010)))
    assert curved.transfer(2000) == pytest.approx(0.006), "a probed link interpolates its curve"
    assert curved.transfer(5000) == pytest.approx(0.018), "and extends it by its last slope"


def test_the_prediction_table_names_the_winner():
    from benchmarks.predictor.api import predict_workload
    from benchmarks.predictor.machine import CollectiveCost, MachineCosts

    zero = CollectiveCost(host=0.0, latency=1e-4)
    numbers = {f.name: 1e-9 for f in dataclasses.fields(MachineCosts) if f.type == "float"}
    machine = MachineCosts(
        **numbers,
        loopback=LOOPBACK,
        start=zero,
        splits=zero,
        values=zero,
        output=zero,
        allreduce=zero,
        facts={},
    )
    prediction = predict_workload(workload(2), machine, "1gbit", pipelines=("base", "sparse-dist"))
    text = str(prediction)
    assert "winner:" in text and prediction.winner.name in text
    assert set(prediction.schedule_ms("sparse-dist")) == {"early", "late", "early-shared", "late-own"}
    assert all(math.isfinite(s.step_ms) and s.step_ms > 0 for s in prediction.steps)


# -- which schedule to pin (benchmarks.predictor.pin) ----------------------------------------------


def _says(**figures: float) -> dict[str, float]:
    """A prediction: the figures given, the rest of the four schedules much slower."""
    return {"early": 50.0, "late": 50.0, "early-shared": 50.0, "late-own": 50.0, **figures}


def test_a_schedule_predicted_fastest_beyond_the_noise_is_pinned():
    from benchmarks.predictor.pin import pin_rule

    pin = pin_rule(_says(early=40.0, late=44.0))
    assert pin.schedule == "early", pin
    assert str(pin).startswith(
        "input_dist_schedule='early': early predicted fastest, 10% ahead of the next, late"
    )
    assert pin_rule(_says(late=40.0)).schedule == "late", (
        "torchrec's order is pinned where it is surely fastest"
    )


@pytest.mark.parametrize(
    "predicted",
    [_says(early=40.0, late=41.0), None, {"early": 40.0}, _says(early=math.nan), _says(late=0.0)],
    ids=["within-the-noise", "none", "missing", "nan", "zero"],
)
def test_where_the_prediction_cannot_tell_or_is_not_usable_the_default_is_kept(predicted):
    from benchmarks.predictor.pin import pin_rule

    pin = pin_rule(predicted)
    assert pin.schedule == "adaptive", pin
    if predicted and all(v > 0 for v in predicted.values()) and len(predicted) == 4:
        assert "early, late predicted within the noise (5%)" in pin.reason, pin.reason


def test_the_ranks_pin_from_their_averaged_predictions():
    from benchmarks.predictor.pin import agreed_pin, pin_rule

    ranks = [_says(early=40.0, late=46.0), _says(early=46.0, late=40.0)]  # each rank alone: opposite pins
    assert {pin_rule(r).schedule for r in ranks} == {"early", "late"}, "the twin: unagreed, they differ"

    def summed(_mine: list[float]) -> list[float]:  # an all_reduce: every rank's figures, summed
        others = [[r[s] for s in ("early", "late", "early-shared", "late-own")] + [1.0] for r in ranks]
        return [sum(column) for column in zip(*others, strict=True)]

    pins = [agreed_pin(r, agree=summed) for r in ranks]
    assert pins[0] == pins[1] and pins[0].schedule == "adaptive", pins  # 43 ms each: within the noise
    assert pins[0].predicted_ms["early"] == pytest.approx(43.0)


# -- the dense timing leaves the model as it was ----------------------------------------------------


class _Dense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 1))

    def forward(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.net(batch)
        return out.square().mean(), out


def test_timing_the_dense_part_changes_nothing_of_the_model():
    torch.manual_seed(0)
    model, batch = _Dense(), torch.rand(16, 4)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    times = time_dense(model, batch, repeats=2)
    assert times is not None and times.forward > 0 and times.backward > 0
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items()), "weights and buffers kept"
    assert all(p.grad is None for p in model.parameters()), "no gradient written"
    assert torch.equal(rng, torch.get_rng_state()), "the random generator put back (dropout drew from it)"
    assert time_dense(nn.Identity(), batch) is None, "a forward without a loss: no timing, no error"


def test_on_a_gpu_the_lookups_come_from_torchrecs_planner_estimator():
    from benchmarks.predictor.planner import gpu_lookup

    small = dataclasses.replace(workload(2), device="cuda")
    heavy = dataclasses.replace(small, batch_size=small.batch_size * 10)
    forward, backward, _ = gpu_lookup(small)
    assert 0 < forward < 1e-3 and backward > forward, "a small table on a GPU: well under a millisecond"
    assert gpu_lookup(heavy)[0] > forward, "10x the ids: a longer lookup"


def test_machine_costs_are_cached_per_set_of_facts(tmp_path, monkeypatch):
    from benchmarks.predictor import machine
    from benchmarks.predictor.machine import CollectiveCost, MachineCosts, machine_costs, machine_facts

    zero = CollectiveCost(host=0.0, latency=1e-4)
    numbers = {f.name: 1e-9 for f in dataclasses.fields(MachineCosts) if f.type == "float"}

    def costs_for(facts: dict) -> MachineCosts:
        pairs = dict.fromkeys(("start", "splits", "values", "output", "allreduce"), zero)
        return MachineCosts(**numbers, **pairs, loopback=LOOPBACK, facts=facts)

    measured = []
    monkeypatch.setattr(
        machine, "_measure", lambda facts, timeout: measured.append(facts) or costs_for(facts)
    )
    path = tmp_path / "costs.json"
    first = machine_costs(path=path)
    assert measured == [machine_facts()] and first.facts == machine_facts(), "measured once"
    assert machine_costs(path=path) == first and len(measured) == 1, "then read from the cache"
    other = {**machine_facts(), "threads": 99}
    monkeypatch.setattr(machine, "machine_facts", lambda: other)
    machine_costs(path=path)
    assert len(measured) == 2, "other facts (another thread count): measured again"
    assert len(json.loads(path.read_text())) == 2, "and kept beside the first"


def test_the_prefetch_stage_hides_the_cache_fill_that_the_others_pay_in_their_lookup():
    c = costs(**COMPUTE, prefetch=0.020)
    assert run_pipeline("sparse-dist", "late", c, cores=2).step == pytest.approx(0.030, rel=1e-6), (
        "SparseDist fills the cache inside its lookup: 10 ms of compute and 20 ms of fill"
    )
    # submitted after forward of i (prefetch_ahead), the fill of i+1 overlaps backward of i; the
    # next forward waits for it: 5 ms of forward + 20 ms of fill
    prefetch = run_pipeline("prefetch", "late", c, cores=2)
    assert prefetch.step == pytest.approx(0.025, rel=1e-6), "Prefetch fills it beside backward"
    assert prefetch.critical == "prefetch", "and forward waits for the fill"
    assert run_pipeline("prefetch", "late", c, cores=1).step == pytest.approx(0.030, rel=1e-6), (
        "one core: the worker and compute take turns, nothing is hidden"
    )


def test_on_cuda_the_copy_of_a_later_batch_overlaps_compute():
    c = costs(**COMPUTE, copy_device=0.004)
    assert run_pipeline("sparse-dist", "early", c, cores=2).step == pytest.approx(0.010, rel=1e-6), (
        "the copy of i+2 runs on the memcpy stream beside the compute of i"
    )
    assert run_pipeline("sparse-dist", "early", costs(**COMPUTE, copy_device=0.015), cores=2).step == (
        pytest.approx(0.015, rel=1e-6)
    ), "a copy longer than the step bounds it"
