"""pipeline.schedule.Tuner with a fake clock: what it runs, what it times, what it keeps."""

from __future__ import annotations

import pytest

from pipeline.schedule import Tuner


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run(cost: dict[str, float], **kw) -> tuple[Tuner, list[str]]:
    """Step a tuner to its decision; a step under schedule s takes cost[s] seconds."""
    clock = FakeClock()
    sums: list[list[float]] = []
    tuner = Tuner(clock=clock, agree=lambda v: sums.append(v) or v, **kw)
    schedules = []
    while tuner.choice is None:
        schedule = tuner.next_schedule()
        schedules.append(schedule)
        clock.now += cost[schedule]
    assert len(sums) == 1  # one agreement, at the decision
    return tuner, schedules


@pytest.mark.parametrize("faster", ["early", "late"])
def test_keeps_the_faster_schedule(faster):
    slower = "late" if faster == "early" else "early"
    tuner, _ = _run({faster: 0.010, slower: 0.012})
    assert tuner.choice == faster
    assert tuner.medians_ms[faster] == pytest.approx(10.0)
    assert tuner.medians_ms[slower] == pytest.approx(12.0)
    assert tuner.next_schedule() == faster  # and stays with it


def test_plan_warmup_then_alternating_blocks():
    _, schedules = _run({"early": 0.01, "late": 0.01}, warmup=2, block=3, rounds=2)
    blocks = ["early"] * 2 + (["early"] * 3 + ["late"] * 3) * 2
    assert schedules == [*blocks, "early"]  # the decision step runs the choice (tie: early)


def test_first_step_of_each_block_is_not_timed():
    # the first step of a block pays for the switch; it must not sway the choice
    clock = FakeClock()
    tuner = Tuner(warmup=0, block=2, rounds=1, clock=clock, agree=lambda v: v)
    costs = iter([5.0, 0.010, 5.0, 0.020])  # early(switch), early, late(switch), late
    while tuner.choice is None:
        tuner.next_schedule()
        clock.now += next(costs, 0.0)
    assert tuner.choice == "early"
    assert tuner.medians_ms == pytest.approx({"early": 10.0, "late": 20.0})


def test_interrupt_drops_the_interval_across_it():
    clock = FakeClock()
    tuner = Tuner(warmup=0, block=3, rounds=1, clock=clock, agree=lambda v: v)
    tuner.next_schedule()  # early, untimed
    clock.now += 0.010
    tuner.next_schedule()  # early, timed
    clock.now += 100.0  # e.g. an eval pass in between
    tuner.interrupt()
    tuner.next_schedule()  # early, timed
    clock.now += 0.010
    for _ in range(3):
        tuner.next_schedule()  # late
        clock.now += 0.030
    tuner.next_schedule()
    assert tuner.choice == "early"
    assert tuner.medians_ms["early"] == pytest.approx(10.0)
