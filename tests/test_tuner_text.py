"""What the "auto" tuner says (`Tuner.reason`, `repr(tuner)`, which `print(pipe.tuner)` shows), case by
case: still tuning, chosen, kept, ruled out, no valid rounds (and tuning again), settled. Every text
says what is compared, what was chosen, by how much, and when the tuner looks again."""

from __future__ import annotations

from pipeline.stages import tuner_text
from pipeline.stages.schedule import SCHEDULES
from pipeline.stages.tuner import Tuner
from tests.test_schedule import RULES, FakeClock, run_tuner

FOUR = ("late", "early", "late-own", "early-shared")


def _interrupted_tuning(**kw) -> tuple[Tuner, FakeClock]:
    """A tuner whose every step is interrupted (an eval step after each training step)."""
    clock = FakeClock()
    tuner = Tuner(clock=clock, agree=lambda v: v, **{**RULES, **kw})
    while tuner.choice is None:
        tuner.next_schedule()
        clock.now += 0.01
        tuner.interrupt()
    return tuner, clock


def test_every_schedule_has_words_saying_both_choices():
    for name, schedule in SCHEDULES.items():
        words = tuner_text.schedule_words(name)
        assert words.startswith(name), words
        if name == "late":
            assert words == "late (torchrec's order)"
        else:
            assert ("before forward" if schedule.early_splits else "after forward") in words, words
            assert ("own process group" if schedule.own_group else "torchrec's process group") in words


def test_still_tuning_says_what_is_compared_for_how_long_and_what_runs():
    text = repr(Tuner())
    assert text.startswith(
        "Tuner(tuning: compares when the next batch's input_dist waits for its splits (before or after "
        "forward) and on which process group its all-to-alls run (one of their own, or torchrec's): "
        "late (torchrec's order), early (splits before forward, own process group), "
    ), text
    assert text.endswith("; decides in at most 86 more steps; late runs now)"), text


def test_chosen_says_what_by_how_much_over_how_many_rounds_and_when_it_rechecks():
    tuner, _, _ = run_tuner({"late": 0.010, "early": 0.009, "late-own": 0.0098, "early-shared": 0.0099})
    assert tuner.choice == "early"
    assert tuner.reason == (
        "early (splits before forward, own process group) is 10.0 % faster than late (torchrec's order) "
        "over 3 paired rounds"
    )
    step = tuner.decisions[-1][0]
    assert repr(tuner) == (
        f"Tuner(at step {step}: {tuner.reason}; re-checks against the runner-up at step {step + 300} "
        "(300 steps from now))"
    )


def test_kept_says_the_margin_and_how_each_other_schedule_did():
    tuner, _, _ = run_tuner({"late": 0.010, "early": 0.0101, "late-own": 0.0099, "early-shared": 0.010})
    assert tuner.choice == "late"
    assert tuner.reason == (
        "kept late (torchrec's order): no other schedule was faster by more than 3 % in the median and "
        "in every one of 3 paired rounds (early 1.0 % slower, late-own 1.0 % faster, early-shared as fast)"
    )
    assert "re-checks against the runner-up at step" in repr(tuner)


def test_ruled_out_names_each_schedule_and_its_first_round_ratio():
    tuner, _, _ = run_tuner({"late": 0.010, "early": 0.009, "late-own": 0.0105, "early-shared": 0.015})
    assert tuner.reason.endswith(
        "; ruled out after the first round as much slower: early-shared (1.67x the best step time)"
    ), tuner.reason
    # every other schedule ruled out: nothing is left to re-check
    tuner, _, _ = run_tuner({"late": 0.010, "early": 0.02, "late-own": 0.02, "early-shared": 0.02})
    alone = "kept late (torchrec's order), the only schedule left after the first round"
    assert tuner.reason.startswith(alone), tuner.reason
    assert repr(tuner).endswith("; never re-checks)"), repr(tuner)


def test_no_valid_rounds_says_why_what_was_kept_and_tunes_again():
    tuner, clock = _interrupted_tuning()
    step = tuner.decisions[-1][0]
    assert tuner.choice == "late"
    assert tuner.reason == (
        "kept late (torchrec's order): no valid rounds to compare, since every round was interrupted by "
        "an eval step, an exception or a reset during its timed steps (36 timed steps lost); tunes again "
        f"at step {step + 300}"
    )
    assert repr(tuner) == f"Tuner(at step {step}: {tuner.reason})"
    calls = step  # the tuner counts its next_schedule() calls as steps
    while not tuner.tuning:  # it does tune again, where it said
        tuner.next_schedule()
        calls += 1
        clock.now += 0.01
    assert calls == step + 300, f"tuned again at step {calls}, not {step + 300}"
    assert repr(tuner).startswith("Tuner(tuning again: compares"), repr(tuner)
    while tuner.tuning:
        tuner.next_schedule()
        clock.now += 0.01
    assert tuner.reason.startswith("kept late (torchrec's order): no other schedule was faster")


def test_no_valid_rounds_without_rechecks_says_it_does_not_tune_again():
    tuner, _ = _interrupted_tuning(recheck_after=0)
    assert tuner.reason.endswith("; does not tune again"), tuner.reason


def test_negative_twin_uninterrupted_steps_are_valid_rounds():
    tuner, _, _ = run_tuner({s: 0.01 for s in FOUR})
    assert "no valid rounds" not in tuner.reason and "3 paired rounds" in tuner.reason


def test_settled_at_one_rank_says_why_and_never_rechecks():
    tuner = Tuner()
    tuner.settle("late", f"kept {tuner_text.schedule_words('late')}: {tuner_text.ONE_RANK}")
    assert repr(tuner) == (
        "Tuner(at step 0: kept late (torchrec's order): one rank: the input all-to-alls move nothing, so "
        "every schedule does the same work; never re-checks)"
    )
