"""torchrec's constructors, class by class, against ours (each class declares its own); the options'
validation; the lane's state enum; `dmp_collection_sync_interval_batches`. One process, no ranks."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn
from torchrec.distributed.model_parallel import DMPCollection
from torchrec.distributed.train_pipeline import pipeline_stage as torchrec_stage
from torchrec.distributed.train_pipeline import train_pipelines as torchrec_pipelines

import pipeline
from pipeline.options import InputDistOptions, PrefetchOptions, RankOptions, RewriteOptions
from pipeline.ranks import Lane, LaneState, Ranks
from tests import models
from tests.test_torchrec_parity import _Echo, _Numbered

CLASSES = (
    "TrainPipelineBase",
    "TrainPipelineSparseDist",
    "PrefetchTrainPipelineSparseDist",
    "TrainPipelineFusedSparseDist",
    "TrainPipelineSemiSync",
    "EvalPipelineSparseDist",
    "StagedTrainPipeline",
)
STAGE_CLASSES = ("SparseDataDistUtil", "PipelineStage")
# What a later torchrec added to a constructor: ours declares it positionally, in that torchrec's
# place, so under an older torchrec it follows that torchrec's parameters instead of being ours.
LATER_TORCHREC = {"async_inplace_copy"}  # torchrec 1.9: SparseDist, Prefetch


def _params(cls: type) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(cls).parameters.values() if p.name != "self"]


@pytest.mark.parametrize("name", CLASSES + STAGE_CLASSES)
def test_ours_take_every_torchrec_parameter_in_torchrec_order(name):
    theirs = getattr(torchrec_pipelines, name, None) or getattr(torchrec_stage, name)
    ours = getattr(pipeline, name)
    their_names = [p.name for p in _params(theirs)]
    positional = [p.name for p in _params(ours) if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional[: len(their_names)] == their_names
    extras = [p for p in _params(ours) if p.name not in their_names and p.name not in LATER_TORCHREC]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in extras), extras


def _echo_pipe(name: str, *args, **kwargs):
    model = _Echo()
    return getattr(pipeline, name)(
        model, torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"), *args, **kwargs
    )


@pytest.mark.parametrize("name", CLASSES[:-1])
def test_every_class_is_a_torchrec_train_pipeline(name):
    assert isinstance(_echo_pipe(name), torchrec_pipelines.TrainPipeline)
    assert pipeline.TrainPipeline is torchrec_pipelines.TrainPipeline


def test_staged_is_a_torchrec_train_pipeline_and_subclasses_answer_as_torchrec():
    stage = pipeline.PipelineStage(name="id", runnable=lambda b: b)
    assert isinstance(pipeline.StagedTrainPipeline([stage]), torchrec_pipelines.TrainPipeline)
    for name in ("PrefetchTrainPipelineSparseDist", "TrainPipelineFusedSparseDist", "TrainPipelineSemiSync"):
        assert isinstance(_echo_pipe(name), pipeline.TrainPipelineSparseDist), name


def test_positional_arguments_land_where_torchrec_puts_them():
    # SparseDist: execute_all_batches is the 4th; dmp_collection_sync_interval_batches the 9th
    pipe = _echo_pipe("TrainPipelineSparseDist", False, False, None, False, None, None)
    outputs = models.run_to_end(pipe, iter([_Numbered(i) for i in range(5)]))
    assert [int(o) for o in outputs] == [0, 1, 2]  # execute_all_batches=False drops the last two
    semi = _echo_pipe("TrainPipelineSemiSync", True, False, 3, True)
    assert (semi._start_batch, semi._stash) == (3, True)  # start_batch and stash_gradients, 6th and 7th


def test_unknown_or_refused_arguments_say_what_to_do():
    with pytest.raises(TypeError, match=r"unexpected keyword.*emb_lookup_stream"):
        _echo_pipe("TrainPipelineBase", emb_lookup_stream="current")
    with pytest.raises(ValueError, match="apply_jit=True is not supported"):
        _echo_pipe("TrainPipelineSparseDist", apply_jit=True)
    with pytest.raises(ValueError, match=r"InputDistOptions\.schedule must be one of"):
        _echo_pipe("TrainPipelineSparseDist", input_dist=InputDistOptions(schedule="soon"))
    with pytest.raises(TypeError, match=r"unexpected keyword.*tuner"):  # the paired-trials tuner is gone
        _echo_pipe("EvalPipelineSparseDist", tuner=None)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: RankOptions(on_uneven="skip"), "on_uneven must be one of"),
        (lambda: RankOptions(failure_grace=-1), "failure_grace must be >= 0"),
        (lambda: RankOptions(peer_timeout=5), "peer_timeout must be a positive timedelta"),
        (lambda: RewriteOptions(method="guess"), r"RewriteOptions\.method must be one of"),
        (lambda: InputDistOptions(schedule="never"), r"InputDistOptions\.schedule must be one of"),
        (lambda: PrefetchOptions(prefetch_ahead="maybe"), "prefetch_ahead must be one of"),
        (lambda: _echo_pipe("TrainPipelineSparseDist", dmp_collection_sync_interval_batches=0), "positive"),
        (lambda: _echo_pipe("TrainPipelineFusedSparseDist", emb_lookup_stream="side"), "emb_lookup_stream"),
        (lambda: _echo_pipe("TrainPipelineSemiSync", start_batch=-1), "start_batch must be an int >= 0"),
    ],
)
def test_options_and_arguments_refuse_bad_values(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_options_are_keyword_only_slots():
    with pytest.raises(TypeError):
        RankOptions("stop")  # type: ignore[misc]
    with pytest.raises(AttributeError):
        RankOptions().typo = 1  # type: ignore[attr-defined]


def test_lane_states():
    ranks = Ranks(RankOptions())
    lane = Lane(iter([1, 2]))
    assert lane.state is LaneState.OPEN
    assert ranks.fetch(lane)[0] == 1 and ranks.fetch(lane)[0] == 2
    assert ranks.fetch(lane) is None  # one process: an exhausted rank adds no placeholder
    assert lane.state is LaneState.EXHAUSTED and lane.fetched == 2
    lane.drain()
    assert lane.state is LaneState.DRAINING and ranks.fetch(lane) is None  # a draining lane fetches nothing
    ended = Lane(iter([]), state=LaneState.ENDED)
    ended.drain()
    assert ended.state is LaneState.ENDED


class _Collection(DMPCollection):
    """A stand-in DMPCollection (2D sharding) that counts its syncs."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self._dmp_wrapped_module = _Echo()
        self.synced_at: list[int] = []
        self.steps = 0

    def forward(self, batch):
        self.steps += 1
        return self._dmp_wrapped_module(batch)

    def sync(self, include_optimizer_state: bool = True) -> None:
        self.synced_at.append(self.steps - 1)


@pytest.mark.parametrize("name", ["TrainPipelineSparseDist", "TrainPipelineSemiSync"])
def test_dmp_collection_syncs_every_n_batches(name):
    model = _Collection()
    pipe = getattr(pipeline, name)(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        torch.device("cpu"),
        dmp_collection_sync_interval_batches=3,
    )
    assert len(models.run_to_end(pipe, iter([_Numbered(i) for i in range(10)]))) == 10
    assert model.synced_at == [0, 3, 6, 9]


def test_dmp_interval_on_another_model_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"dmp_collection_sync_interval_batches=2 .* DMPCollection"):
        _echo_pipe("TrainPipelineSparseDist", dmp_collection_sync_interval_batches=2)
    _echo_pipe("TrainPipelineSparseDist", dmp_collection_sync_interval_batches=None)  # torchrec's "off"
    _echo_pipe("TrainPipelineSemiSync", dmp_collection_sync_interval_batches=1)  # torchrec's default


ALL_CLASSES = (*CLASSES, "TrainPipelinePT2", "TrainPipelineSparseDistCompAutograd", "SparseDataDistUtil")


@pytest.mark.parametrize("name", ALL_CLASSES)
def test_constructor_is_declared_in_code_without_var_args(name):
    cls = getattr(pipeline, name)
    assert "__init__" in vars(cls), f"{name} inherits its constructor instead of declaring it"
    kinds = {p.kind for p in inspect.signature(cls).parameters.values()}
    assert not kinds & {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}, name


def test_our_options_have_one_way_in_the_options_objects():
    grouped = _echo_pipe(
        "TrainPipelineSparseDist",
        ranks=RankOptions(on_uneven="error"),
        input_dist=InputDistOptions(schedule="early"),
    )
    assert grouped._ranks._options == RankOptions(on_uneven="error")
    assert grouped.input_dist_schedule == "early"
    for flat in ({"on_uneven": "error"}, {"input_dist_schedule": "early"}, {"narrow_ids": False}):
        with pytest.raises(TypeError, match="unexpected keyword"):  # not a second name of a field
            _echo_pipe("TrainPipelineSparseDist", **flat)


@pytest.mark.parametrize(
    ("name", "keyword", "where"),
    [
        ("TrainPipelineSparseDist", "input_dist_schedule", "input_dist=InputDistOptions(schedule="),
        ("TrainPipelineSparseDist", "narrow_ids", "input_dist=InputDistOptions(narrow_ids="),
        ("TrainPipelineBase", "rewrite_method", "rewrite=RewriteOptions(method="),
        ("TrainPipelineSparseDist", "arg_paths", "rewrite=RewriteOptions(arg_paths="),
        ("TrainPipelineSemiSync", "on_uneven", "ranks=RankOptions(on_uneven="),
        ("TrainPipelineSparseDist", "peer_timeout", "ranks=RankOptions(peer_timeout="),
        ("PrefetchTrainPipelineSparseDist", "prefetch_ahead", "prefetch=PrefetchOptions(prefetch_ahead="),
        ("PrefetchTrainPipelineSparseDist", "prefetch_watch", "prefetch=PrefetchOptions(watch="),
    ],
)
def test_a_keyword_of_an_earlier_release_says_which_options_field_took_it(name, keyword, where):
    """A keyword that became an options field is refused as Python refuses any unknown keyword,
    naming the field that takes it now; a keyword that never was one gets Python's own error."""
    with pytest.raises(TypeError, match="unexpected keyword") as info:
        _echo_pipe(name, **{keyword: None})
    assert where in str(info.value), str(info.value)
    with pytest.raises(TypeError, match="unexpected keyword") as info:
        _echo_pipe(name, not_an_option=None)
    assert "Options(" not in str(info.value), str(info.value)
    # the constructor's signature is still the declared one (an editor and help() show it)
    assert keyword not in inspect.signature(getattr(pipeline, name)).parameters


def test_a_subclass_that_declares_an_earlier_keyword_takes_it_as_its_own():
    """A user's subclass whose constructor declares `on_uneven=` (and maps it onto the options
    object itself) is built as written; only a class that does not declare it is refused."""

    class Migrating(pipeline.TrainPipelineSparseDist):
        def __init__(self, model, optimizer, device, on_uneven: str = "stop") -> None:
            super().__init__(model, optimizer, device, ranks=RankOptions(on_uneven=on_uneven))

    model = _Echo()
    pipe = Migrating(
        model, torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"), on_uneven="error"
    )
    assert pipe._ranks._options == RankOptions(on_uneven="error")
