"""pipeline.stages.overlap: the trial that decides whether the prefetch stage runs ahead or inline,
with fake clocks (what it runs, what it times, what it keeps and says). The Prefetch pipeline under
a real trial, on 2 ranks and the tiered kernel: tests/test_tiered_dist.py."""

from __future__ import annotations

import pytest

from pipeline.stages.overlap import OverlapTrial


class Clocks:
    """Wall and process CPU clocks that the test advances."""

    def __init__(self) -> None:
        self.wall = 0.0
        self.cpu = 0.0


def run_trial(step_s, cpu_s, steps: int, **kw) -> tuple[OverlapTrial, list[bool], list[list[float]]]:
    """Step a trial; a step ahead (True) or inline (False) takes step_s[mode] seconds of wall time
    and cpu_s[mode] of process CPU."""
    clocks, sums = Clocks(), []
    settings = {"warmup": 2, "block": 3, "settle": 1, "rounds": 3, "cores": 2, "local_ranks": 2, **kw}
    trial = OverlapTrial(
        clock=lambda: clocks.wall,
        cpu_clock=lambda: clocks.cpu,
        agree=lambda v: sums.append(v) or v,
        **settings,
    )
    modes = []
    for _ in range(steps):
        ahead = trial.next_step()
        modes.append(ahead)
        clocks.wall += step_s[ahead]
        clocks.cpu += cpu_s[ahead]
    return trial, modes, sums


def test_overlap_that_pays_keeps_the_stage_ahead():
    trial, modes, sums = run_trial({True: 0.08, False: 0.12}, {True: 0.1, False: 0.08}, steps=30)
    assert trial.result is not None and trial.result.ahead, "a 33 % faster step ahead must be kept"
    assert trial.result.step_ms == {"ahead": pytest.approx(80.0), "inline": pytest.approx(120.0)}
    assert trial.result.reason.startswith("prefetch runs ahead on its worker thread: overlap pays")
    assert len(sums) == 1 and all(modes[trial.decided_at - 1 :]), "ahead from the decision on"


def test_overlap_that_fills_the_cores_runs_the_stage_inline():
    """The `tiered` benchmark's case on 2 cores: ahead, the step is longer and the CPU doubles."""
    trial, modes, _ = run_trial({True: 0.21, False: 0.12}, {True: 0.14, False: 0.062}, steps=30)
    result = trial.result
    assert result is not None and not result.ahead, "a slower step ahead must fall back to inline"
    assert result.cpu_ms == {"ahead": pytest.approx(140.0), "inline": pytest.approx(62.0)}
    assert result.busy == pytest.approx(0.14 * 2 / (0.21 * 2))
    assert result.reason.startswith("prefetch runs inline: running it ahead is not faster"), result.reason
    assert not any(modes[trial.decided_at - 1 :]), "inline from the decision on"


def test_saturated_cores_are_named_in_the_reason():
    trial, _, _ = run_trial({True: 0.15, False: 0.15}, {True: 0.15, False: 0.1}, steps=30)
    assert not trial.result.ahead, "a tie keeps the plain order (inline)"
    assert trial.result.reason.startswith("prefetch runs inline: the reads' CPU fills the cores (")
    assert "cores 100% busy ahead" in trial.result.reason


def test_small_gain_stays_inline():
    trial, _, _ = run_trial({True: 0.099, False: 0.1}, {True: 0.05, False: 0.05}, steps=30)
    assert not trial.result.ahead, "1 % is within the margin: inline must be kept"


def test_without_a_margin_a_small_gain_runs_ahead():
    """The negative twin of the test above: the margin is what keeps a 1 % gain inline."""
    trial, _, _ = run_trial({True: 0.099, False: 0.1}, {True: 0.05, False: 0.05}, steps=30, margin=0.0)
    assert trial.result.ahead, "with margin 0 a gain in every round must run ahead"


@pytest.mark.parametrize("interrupted", [True, False])
def test_an_interrupted_step_is_not_timed(interrupted):
    """An eval pass of 10 s between two timed ahead steps: `interrupt()` keeps it out of the trial
    (ahead, 20 % faster, is kept); without it (the negative twin) the 10 s count as a step ahead."""
    clocks = Clocks()
    trial = OverlapTrial(
        warmup=1, block=3, settle=1, rounds=1, clock=lambda: clocks.wall, cpu_clock=lambda: clocks.cpu,
        agree=lambda v: v, cores=2, local_ranks=1,
    )  # fmt: skip
    for step in range(12):
        ahead = trial.next_step()
        clocks.wall += 0.08 if ahead else 0.1
        if step == 2:  # a timed step ahead (step 0 settles the switch, 1 and 2 are timed)
            clocks.wall += 10.0  # the eval pass
            if interrupted:
                trial.interrupt()
    assert trial.result is not None and trial.result.ahead is interrupted, trial.result


def test_plan_alternates_and_rotates_blocks_after_the_warmup():
    _, modes, _ = run_trial({True: 0.1, False: 0.1}, {True: 0.1, False: 0.1}, steps=21)
    blocks = ([True] * 3 + [False] * 3, [False] * 3 + [True] * 3, [True] * 3 + [False] * 3)
    assert modes[:1] == [True], "warm-up steps run ahead (the stage's choice before a decision)"
    assert modes[1:19] == [m for block in blocks for m in block], f"plan: {modes}"


def test_settle_steps_and_busy_steps_are_not_timed():
    """A first step of each block that takes 10 s must not change the decision; nor steps taken
    while another trial (the input_dist tuner) is measuring."""
    clocks, trial = Clocks(), None
    trial = OverlapTrial(
        warmup=1, block=3, settle=1, rounds=3, clock=lambda: clocks.wall, cpu_clock=lambda: clocks.cpu,
        agree=lambda v: v, cores=2, local_ranks=1,
    )  # fmt: skip
    previous = None
    for step in range(40):
        busy = step < 5
        ahead = trial.next_step(busy=busy)
        switch = previous is not None and ahead != previous
        clocks.wall += 10.0 if (switch or busy) else (0.05 if ahead else 0.1)
        previous = ahead
    assert trial.result is not None and trial.result.ahead, "the untimed steps decided the trial"
    assert trial.result.step_ms["ahead"] == pytest.approx(50.0)


def test_recheck_can_change_the_decision():
    clocks = Clocks()
    cost = {True: 0.08, False: 0.1}
    trial = OverlapTrial(
        warmup=1, block=2, settle=1, rounds=2, recheck_after=10, clock=lambda: clocks.wall,
        cpu_clock=lambda: clocks.cpu, agree=lambda v: v, cores=2, local_ranks=1,
    )  # fmt: skip
    decisions = []
    for _ in range(60):
        ahead = trial.next_step()
        clocks.wall += cost[ahead]
        if trial.result is not None and (not decisions or decisions[-1][0] != trial.decided_at):
            decisions.append((trial.decided_at, trial.result.ahead))
            cost = {True: 0.2, False: 0.1}  # the machine changed: overlap no longer pays
    assert [d[1] for d in decisions[:2]] == [True, False], f"decisions: {decisions}"
    assert decisions[1][0] - decisions[0][0] >= 10, "the re-check ran before its interval"


def test_decided_trial_reads_no_clock_until_the_recheck():
    reads = []
    trial = OverlapTrial(
        warmup=0, block=2, settle=1, rounds=1, recheck_after=0, clock=lambda: reads.append(1) or 0.0,
        cpu_clock=lambda: 0.0, agree=lambda v: v, cores=1, local_ranks=1,
    )  # fmt: skip
    for _ in range(6):
        trial.next_step()
    before = len(reads)
    for _ in range(100):
        trial.next_step()
    assert trial.result is not None and len(reads) == before, "a decided trial must cost no clock read"


def test_rejects_bad_settings():
    with pytest.raises(ValueError, match="bad overlap trial"):
        OverlapTrial(block=2, settle=2)
