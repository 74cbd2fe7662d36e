"""pipeline.stages.schedule: the four schedules, their words, and "auto", the deprecated name of the
default ("adaptive"): it warns once where it is given and runs the default's watch."""

from __future__ import annotations

import warnings

import pytest
import torch

import pipeline
from pipeline import InputDistOptions, ScheduleWatch
from pipeline.stages.schedule import ONE_RANK, SCHEDULES, schedule_words


def test_schedules_are_the_two_choices_crossed():
    assert {(s.early_splits, s.own_group) for s in SCHEDULES.values()} == {
        (True, True),
        (True, False),
        (False, True),
        (False, False),
    }
    assert SCHEDULES["early"].own_group and not SCHEDULES["late"].own_group


def test_every_schedule_has_words_saying_both_choices():
    for name, schedule in SCHEDULES.items():
        words = schedule_words(name)
        assert words.startswith(name), words
        if name == "late":
            assert words == "late (torchrec's order)"
        else:
            assert ("before forward" if schedule.early_splits else "after forward") in words, words
            assert ("own process group" if schedule.own_group else "torchrec's process group") in words


def _pipe(**options) -> tuple[pipeline.TrainPipelineSparseDist, list[warnings.WarningMessage]]:
    """A SparseDist made with `options` (one rank, nothing run), and the deprecation warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = pipeline.TrainPipelineSparseDist(torch.nn.Linear(1, 1), None, torch.device("cpu"), **options)
    return pipe, [w for w in caught if issubclass(w.category, DeprecationWarning)]


def test_auto_warns_once_and_runs_the_default_watch():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe, said = _pipe(input_dist=InputDistOptions(schedule="auto"))
    said = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(said) == 1, [str(w.message) for w in said]
    words = 'InputDistOptions(schedule="auto"): "auto" is a deprecated name of the default, "adaptive"'
    assert words in str(said[0].message)
    assert said[0].filename == __file__, "the warning names the caller's line, not the library's"
    assert isinstance(pipe.tuner, ScheduleWatch), type(pipe.tuner)
    assert pipe.input_dist_schedule == "late", "the default starts in torchrec's order"
    assert ONE_RANK in repr(pipe.tuner), "at one rank the default's watch is pinned, as under 'adaptive'"


def test_auto_in_an_options_object_warns_when_it_is_made_and_not_again():
    with pytest.warns(DeprecationWarning, match="deprecated name of the default"):
        options = InputDistOptions(schedule="auto")
    assert options.schedule == "adaptive"
    pipe, said = _pipe(input_dist=options)
    assert not said, "the pipeline made from the options warns no second time"
    assert isinstance(pipe.tuner, ScheduleWatch)


@pytest.mark.parametrize("schedule", ["late", "early", "adaptive"])
def test_twin_a_current_name_does_not_warn_and_only_the_default_has_a_watch(schedule):
    pipe, said = _pipe(input_dist=InputDistOptions(schedule=schedule))
    assert not said, [str(w.message) for w in said]
    if schedule == "adaptive":
        assert isinstance(pipe.tuner, ScheduleWatch)
    else:
        assert pipe.tuner is None, f"a pinned schedule ({schedule}) has no watch"
        assert pipe.input_dist_schedule == schedule


def test_the_tuner_keyword_is_gone():
    with pytest.raises(TypeError, match="unexpected keyword argument 'tuner'"):
        _pipe(tuner=None)
    assert not hasattr(pipeline, "Tuner")
