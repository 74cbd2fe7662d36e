"""pipeline.stages.schedule: the paired decision rule, and the Tuner with a fake clock (what it runs, what it
times, what it keeps, when it re-checks)."""

from __future__ import annotations

import math

import pytest

from pipeline.stages.schedule import SCHEDULES, decide
from pipeline.stages.tuner import Tuner

FOUR = ("late", "early", "late-own", "early-shared")


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


RULES = {"rounds": 3, "margin": 0.03, "recheck_after": 300}
"""The rule's settings these scenarios were written for (the defaults are longer and never re-check:
`test_default_tuning_is_short` runs those)."""


def run_tuner(
    cost, steps: int | None = None, *, defaults: bool = False, **kw
) -> tuple[Tuner, list[str], list[list[float]]]:
    """Step a tuner; a step under schedule s takes cost(s, step) seconds. Until its first decision, or
    for `steps` steps. With a `prior`, the tuner starts from it."""
    clock = FakeClock()
    sums: list[list[float]] = []
    tuner = Tuner(clock=clock, agree=lambda v: sums.append(v) or v, **{**({} if defaults else RULES), **kw})
    tuner.start_from_prior()
    schedules: list[str] = []
    while (tuner.choice is None) if steps is None else len(schedules) < steps:
        schedule = tuner.next_schedule()
        schedules.append(schedule)
        clock.now += cost(schedule, len(schedules)) if callable(cost) else cost[schedule]
    return tuner, schedules, sums


def test_schedules_are_the_two_choices_crossed():
    assert {(s.early_splits, s.own_group) for s in SCHEDULES.values()} == {
        (True, True),
        (True, False),
        (False, True),
        (False, False),
    }
    assert SCHEDULES["early"].own_group and not SCHEDULES["late"].own_group


def test_decide_keeps_baseline_without_a_win_in_every_round():
    rounds = [{"late": 10.0, "early": 9.5}, {"late": 10.0, "early": 9.5}, {"late": 10.0, "early": 10.5}]
    d = decide(rounds, baseline="late", margin=0.03)
    assert d.choice == "late" and d.reason == ""  # numbers only: tuner_text words it
    assert d.ratios["early"] == pytest.approx([0.95, 0.95, 1.05])


def test_decide_lets_a_large_gain_lose_one_round_of_three():
    # 20 % faster in two rounds, one disturbed round: a real gain, taken
    rounds = [{"late": 10.0, "early": 8.0}, {"late": 10.0, "early": 8.0}, {"late": 10.0, "early": 10.5}]
    assert decide(rounds, baseline="late", margin=0.03).choice == "early"
    # but not two lost rounds, nor one lost round of two
    assert decide([*rounds, rounds[2]], baseline="late", margin=0.03).choice == "late"
    assert decide(rounds[1:], baseline="late", margin=0.03).choice == "late"


def test_decide_needs_more_than_the_margin():
    rounds = [{"late": 10.0, "early": 9.8}] * 3  # 2 % faster every time: below a 3 % margin
    assert decide(rounds, baseline="late", margin=0.03).choice == "late"
    assert decide(rounds, baseline="late", margin=0.01).choice == "early"


def test_decide_takes_the_best_winner_and_drops_invalid_rounds():
    rounds = [
        {"late": 10.0, "early": 7.0, "late-own": 8.0},
        {"late": math.inf, "early": 1.0, "late-own": 1.0},  # a round with an untimed block
        {"late": 12.0, "early": 9.0, "late-own": 9.0},
    ]
    d = decide(rounds, baseline="late", margin=0.03)
    assert d.choice == "early" and len(d.ratios["early"]) == 2


def test_plan_is_interleaved_and_rotated():
    _, schedules, _ = run_tuner(
        {s: 0.01 for s in FOUR}, warmup=2, block=2, rounds=2, settle=1, visit=0, recheck_after=0
    )
    blocks = [schedules[2 + 2 * i] for i in range(8)]
    assert schedules[:2] == ["late", "late"]
    assert blocks == [*FOUR, *FOUR[1:], FOUR[0]]  # round 1 starts one later
    assert all(schedules[2 + 2 * i] == schedules[3 + 2 * i] for i in range(8))


@pytest.mark.parametrize("faster", FOUR)
def test_keeps_the_significantly_faster_schedule(faster):
    tuner, _, sums = run_tuner({s: 0.010 if s == faster else 0.012 for s in FOUR})
    assert len(sums) == 2  # two agreements: after the first round (to rule losers out), at the decision
    assert tuner.choice == faster
    assert tuner.medians_ms[faster] == pytest.approx(10.0)
    assert tuner.next_schedule() == faster  # and stays with it


def test_noise_without_a_consistent_gain_keeps_torchrecs_order():
    # early is faster in some rounds and slower in others: no switch
    def cost(schedule: str, step: int) -> float:
        if schedule != "early":
            return 0.010
        return 0.008 if (step // 16) % 2 else 0.012

    tuner, _, _ = run_tuner(cost, warmup=3, block=5, settle=2, visit=2)
    assert tuner.choice == "late"
    assert tuner.reason.startswith("kept late")


def test_first_steps_of_each_block_and_the_visits_are_not_timed():
    # the first `settle` steps of a block pay for the switch, and each schedule's first use pays
    # for setting it up; neither may sway the choice
    def cost(schedule: str, step: int) -> float:
        visiting = step <= 2 * 2
        settling = (step - 1 - 2 * 2) % 5 < 2
        slow = visiting or settling
        return 5.0 if slow and schedule == "early" else {"early": 0.010, "late": 0.020}[schedule]

    tuner, schedules, _ = run_tuner(
        cost, candidates=("late", "early"), warmup=0, rounds=2, visit=2, block=5, settle=2
    )
    assert schedules[:4] == ["late", "late", "early", "early"]  # the visits
    assert tuner.choice == "early"
    assert tuner.medians_ms == pytest.approx({"early": 20.0 / 2, "late": 20.0})


def test_tuning_steps_are_counted():
    tuner, schedules, _ = run_tuner({s: 0.01 for s in FOUR}, warmup=3, block=5, rounds=3)
    assert tuner.tuning_steps == 3 + 4 * 1 + 3 * 4 * 5 == len(schedules) - 1


def test_recheck_switches_when_the_runner_up_becomes_faster():
    # early wins the tuning; after step 100 late-own becomes the fastest by far
    def cost(schedule: str, step: int) -> float:
        if step > 100 and schedule == "late-own":
            return 0.005
        return {"early": 0.008, "late-own": 0.009}.get(schedule, 0.010)

    tuner, schedules, sums = run_tuner(cost, steps=200, recheck_after=60, recheck_rounds=2, block=4)
    first, second = tuner.decisions
    assert first[1].choice == "early" and second[1].choice == "late-own"
    assert second[0] == first[0] + 60 + 2 * 2 * 4
    assert len(sums) == 3 and len(sums[2]) == 2 * 2  # re-check: 2 rounds x (choice, runner-up)
    assert set(schedules[first[0] : first[0] + 59]) == {"early"}
    assert schedules[-1] == "late-own"


def test_recheck_keeps_the_choice_without_significant_evidence():
    tuner, _, _ = run_tuner(
        {"early": 0.008, "late-own": 0.009, "late": 0.01, "early-shared": 0.01}, steps=300, recheck_after=60
    )
    assert [d.choice for _, d in tuner.decisions] == ["early", "early", "early"]  # intervals 60, 120


def test_interrupt_drops_the_interval_across_it():
    clock = FakeClock()
    tuner = Tuner(
        candidates=("late", "early"),
        warmup=0,
        block=3,
        rounds=1,
        settle=1,
        visit=0,
        clock=clock,
        agree=lambda v: v,
    )
    tuner.next_schedule()  # late, untimed
    clock.now += 0.020
    tuner.next_schedule()  # late, timed
    clock.now += 100.0  # e.g. an eval pass in between
    tuner.interrupt()
    tuner.next_schedule()  # late, timed
    clock.now += 0.020
    for _ in range(3):
        tuner.next_schedule()  # early
        clock.now += 0.010
    tuner.next_schedule()
    assert tuner.choice == "early"
    assert tuner.medians_ms["late"] == pytest.approx(20.0)


def test_rejects_bad_settings():
    with pytest.raises(ValueError, match="bad tuner settings"):
        Tuner(candidates=("early", "sideways"))
    with pytest.raises(ValueError, match="bad tuner settings"):
        Tuner(candidates=("early",), baseline="late")


def test_default_tuning_is_short():
    # warm-up 2, a visit of each of 4 schedules, 5 rounds of 4-step blocks: 86 steps at most
    tuner, schedules, _ = run_tuner({s: 0.01 for s in FOUR}, defaults=True)
    assert len(schedules) - 1 == tuner.tuning_steps == 2 + 4 + 5 * 4 * 4


def test_first_round_rules_out_a_much_slower_schedule():
    # early-shared is 1.5x the best in the first round: it runs no more rounds, and is named
    costs = {"late": 0.010, "early": 0.009, "late-own": 0.0105, "early-shared": 0.015}
    tuner, schedules, _ = run_tuner(costs)
    assert tuner.choice == "early"
    after_first_round = schedules[2 + 4 + 4 * 4 :]
    assert "early-shared" not in after_first_round and "late" in after_first_round
    assert tuner.tuning_steps == 2 + 4 + 4 * 4 + 2 * 3 * 4
    assert "early-shared (1.67x the best step time)" in tuner.reason
    assert set(tuner.medians_ms) == set(FOUR)  # the ruled-out one keeps its first-round figure


def test_a_baseline_alone_after_the_first_round_is_kept_at_once():
    costs = {"late": 0.010, "early": 0.02, "late-own": 0.02, "early-shared": 0.02}
    tuner, _schedules, _ = run_tuner(costs)
    assert tuner.choice == "late" and tuner.tuning_steps == 2 + 4 + 4 * 4


def test_a_much_slower_baseline_is_ruled_out_and_the_rounds_best_takes_its_place():
    # late (torchrec's order, the baseline) is 1.4x early in the first round: it runs no more
    # rounds, and early is compared with late-own in the next two
    costs = {"late": 0.014, "early": 0.010, "late-own": 0.0105, "early-shared": 0.02}
    tuner, schedules, _ = run_tuner(costs)
    assert tuner.choice == "early"
    after_first_round = schedules[2 + 4 + 4 * 4 : -1]
    assert set(after_first_round) == {"early", "late-own"}
    assert tuner.tuning_steps == 2 + 4 + 4 * 4 + 2 * 2 * 4
    assert "late (1.40x the best step time)" in tuner.reason and tuner.decisions[-1][1].baseline == "early"
    # the slower baseline may still win when it is not ruled out: 1.2x is under drop_above
    tuner, _, _ = run_tuner({"late": 0.012, "early": 0.010, "late-own": 0.02, "early-shared": 0.02})
    assert tuner.choice == "early" and tuner.decisions[-1][1].baseline == "late"


def test_decided_tuner_reads_no_clock_until_the_recheck():
    reads = []
    tuner = Tuner(
        candidates=("late", "early"), clock=lambda: reads.append(1) or len(reads) * 0.01, agree=lambda v: v
    )
    while tuner.choice is None:
        tuner.next_schedule()
    before = len(reads)
    for _ in range(100):
        tuner.next_schedule()
    assert len(reads) == before


def test_state_dict_round_trip_skips_tuning():
    costs = {"late": 0.012, "early": 0.010, "late-own": 0.012, "early-shared": 0.012}
    tuner, _schedules, _ = run_tuner(costs, steps=120, recheck_after=100)
    assert Tuner().state_dict() == {}  # nothing decided yet: nothing to keep
    state = tuner.state_dict()
    fresh = Tuner(clock=FakeClock(), agree=lambda v: v)
    fresh.load_state_dict(state)
    assert repr(fresh) == repr(tuner), "a loaded tuner says something else"
    assert [fresh.next_schedule() for _ in range(3)] == ["early"] * 3  # no warm-up, no trials
    assert fresh.decisions == tuner.decisions and fresh.medians_ms == tuner.medians_ms
    assert not fresh.tuning
    assert f"re-checks against the runner-up at step {state['next_check']}" in repr(fresh)
    with pytest.raises(ValueError, match="sideways"):
        fresh.load_state_dict({**state, "choice": "sideways"})


def test_repr_says_it_is_still_tuning_and_for_how_long():
    tuner = Tuner()
    assert tuner.tuning
    assert repr(tuner).startswith("Tuner(tuning: compares when the next batch's input_dist waits")
    assert "decides in at most 86 more steps; late runs now)" in repr(tuner)
    for _ in range(10):
        tuner.next_schedule()
    assert tuner.steps_left == 76 and "at most 76 more steps; late runs now" in repr(tuner)


def test_settle_keeps_a_choice_without_trials_or_rechecks():
    from pipeline.stages.tuner import Tuner

    tuner = Tuner(recheck_after=5)
    tuner.settle("late", "one rank: nothing to schedule")
    assert not tuner.tuning and tuner.choice == "late", tuner
    assert [tuner.next_schedule() for _ in range(20)] == ["late"] * 20, "a settled tuner tried others"
    assert tuner.tuning_steps == 0 and tuner.reason == "one rank: nothing to schedule"
    assert Tuner().state_dict() == {} and tuner.state_dict()["choice"] == "late"  # saved like a decision
    with pytest.raises(ValueError, match="no input_dist schedule 'soon'"):
        tuner.settle("soon", "")


# -- starting from the cost model's prediction (pipeline.stages.prediction) ---------------------------


def _says(**figures: float) -> dict[str, float]:
    """A prior that predicts these step times (ms) per schedule."""
    return dict(figures)


def test_a_sure_prediction_is_measured_against_torchrecs_order_only():
    # early predicted 20 % faster: only early and late (torchrec's order, never dropped: the model's
    # error may exceed the noise) are measured, early first
    costs = {"early": 0.008, "late": 0.010, "late-own": 0.010, "early-shared": 0.011}
    predictor = _says(early=8.0, late=10.0, **{"late-own": 10.0, "early-shared": 11.0})
    tuner, schedules, _ = run_tuner(costs, steps=100, prior=predictor)
    assert set(schedules) == {"early", "late"} and schedules[:2] == ["early", "early"], schedules[:12]
    assert tuner.choice == "early" and "measured against late" in tuner.reason, tuner.reason
    # the checkpoint keeps it: a restarted tuner neither predicts nor tries
    fresh = Tuner(clock=FakeClock(), agree=lambda v: pytest.fail("planned again"), prior=tuner.predicted_ms)
    fresh.load_state_dict(tuner.state_dict())
    fresh.start_from_prior()
    assert fresh.next_schedule() == "early" and fresh.reason == tuner.reason
    assert (
        fresh.predicted_ms
        == tuner.predicted_ms
        == {"early": 8.0, "late": 10.0, "late-own": 10.0, "early-shared": 11.0}
    )


def test_a_sure_prediction_of_torchrecs_order_runs_no_trials():
    costs = {"early": 0.012, "late": 0.010, "late-own": 0.012, "early-shared": 0.013}
    predictor = _says(early=12.0, late=10.0, **{"late-own": 12.0, "early-shared": 13.0})  # late by 20 %
    tuner, schedules, sums = run_tuner(costs, steps=100, prior=predictor)
    assert schedules == ["late"] * 100, "torchrec's order from the first step on"
    assert tuner.tuning_steps == 0 and not tuner.tuning and len(sums) == 1, "no trial, one agreement"
    assert tuner.choice == "late" and "no trials" in tuner.reason and "20% slower" in tuner.reason


def test_without_a_prediction_the_same_steps_are_tried_first():
    # the negative twin of the test above: no predictor, the four schedules are measured
    costs = {"early": 0.008, "late": 0.010, "late-own": 0.010, "early-shared": 0.011}
    tuner, schedules, _ = run_tuner(costs)
    assert tuner.choice == "early" and tuner.tuning_steps > 0 and set(schedules) == set(FOUR)


def test_a_prediction_within_the_noise_tries_only_those_schedules():
    # early and late-own are predicted 3 % apart (noise 5 %): they are measured, the others are not;
    # late-own is in fact 20 % faster, and the trials find it
    costs = {"early": 0.010, "late-own": 0.008, "late": 0.012, "early-shared": 0.013}
    predictor = _says(early=10.0, late=12.0, **{"late-own": 10.3, "early-shared": 13.0})
    tuner, schedules, _ = run_tuner(costs, prior=predictor)
    assert set(schedules) == {"early", "late-own", "late"}, (
        "the schedules the model cannot tell apart, and late"
    )
    assert schedules[:2] == ["early", "early"], "the warm-up runs the predicted best"
    assert tuner.choice == "late-own" and tuner.reason.startswith("predicted within the noise (5%)")
    assert tuner.tuning_steps <= 2 + 3 + 5 * 3 * 4, "warm-up, three visits, five rounds of three blocks"


@pytest.mark.parametrize(
    "prior",
    [None, {"early": 1.0}, {s: math.nan for s in FOUR}],
    ids=["none", "partial", "nan"],
)
def test_no_usable_prior_leaves_every_trial(prior):
    tuner = Tuner(clock=FakeClock(), agree=lambda v: v, prior=prior)
    tuner.start_from_prior()
    assert tuner.steps_left == 86 and tuner.predicted_ms == {} and tuner.choice is None


def test_the_ranks_average_their_predictions_before_planning():
    # this rank predicts early best by 20 %, the other late by 20 %: averaged, they tie
    mine = {"early": 8.0, "late": 10.0, "late-own": 12.0, "early-shared": 12.0}
    theirs = {"early": 10.0, "late": 8.0, "late-own": 12.0, "early-shared": 12.0}
    other = [theirs[s] for s in FOUR] + [1.0]  # the other rank's figures, in the candidates' order, and 1
    tuner = Tuner(
        clock=FakeClock(),
        agree=lambda v: [a + b for a, b in zip(v, other, strict=True)],
        prior=mine,
    )
    tuner.start_from_prior()
    assert tuner.predicted_ms == {"late": 9.0, "early": 9.0, "late-own": 12.0, "early-shared": 12.0}
    assert tuner.tuning and "early" in repr(tuner) and "late-own" not in repr(tuner), "early and late tried"


def test_the_prior_is_agreed_once_and_only_before_the_first_step():
    calls = []
    tuner = Tuner(clock=FakeClock(), agree=lambda v: calls.append(1) or v, prior=_says(late=1.0))
    tuner.next_schedule()
    tuner.start_from_prior()
    assert calls == [], "after the first step the plan is under way: the prior is not used"
    tuner = Tuner(clock=FakeClock(), agree=lambda v: calls.append(1) or v, prior=_says(late=1.0))
    tuner.start_from_prior()
    tuner.start_from_prior()
    assert calls == [1], "once"
