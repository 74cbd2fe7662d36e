"""torchrec's experimental backward-injection pipelines (BwdOpt, OptStash, EmbStash, PrefetchEMS)
against ours, by `inspect`: every torchrec parameter by name, in torchrec's order, with torchrec's
default; ours keyword-only after them; declared in code; the same class relations as torchrec's.
One process, no ranks, nothing constructed."""

from __future__ import annotations

import inspect

import pytest
from torchrec.distributed.train_pipeline import experimental_pipelines as torchrec_experimental
from torchrec.distributed.train_pipeline import train_pipelines as torchrec_pipelines

import pipeline

CLASSES = (
    "TrainPipelineSparseDistBwdOpt",
    "TrainPipelineSparseDistOptStash",
    "TrainPipelineSparseDistEmbStash",
    "TrainPipelinePrefetchEMS",
)
# accepted and unused by ours; its default is our TrainPipelineContext (as TrainPipelineSparseDist's)
OWN_DEFAULT = {"context_type": pipeline.TrainPipelineContext}


def _params(cls: type) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(cls).parameters.values() if p.name != "self"]


@pytest.mark.parametrize("name", CLASSES)
def test_ours_take_torchrecs_parameters_in_its_order_with_its_defaults(name):
    theirs, ours = _params(getattr(torchrec_experimental, name)), _params(getattr(pipeline, name))
    positional = [p for p in ours if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert [p.name for p in positional] == [p.name for p in theirs], f"{name}: names or order differ"
    for mine, their in zip(positional, theirs, strict=True):
        if mine.name in OWN_DEFAULT:
            assert mine.default is OWN_DEFAULT[mine.name], f"{name}.{mine.name}: {mine.default}"
        else:
            assert mine.default == their.default, f"{name}.{mine.name}: {mine.default} != {their.default}"
    extras = ours[len(positional) :]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in extras), f"{name}: {extras}"


@pytest.mark.parametrize("name", CLASSES)
def test_constructor_is_declared_in_code_without_var_args(name):
    cls = getattr(pipeline, name)
    assert "__init__" in vars(cls), f"{name} inherits its constructor instead of declaring it"
    kinds = {p.kind for p in _params(cls)}
    assert not kinds & {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}, name


@pytest.mark.parametrize("name", CLASSES)
def test_ours_is_a_torchrec_train_pipeline_and_a_sparse_dist_as_torchrecs_is(name):
    ours, theirs = getattr(pipeline, name), getattr(torchrec_experimental, name)
    assert issubclass(ours, torchrec_pipelines.TrainPipeline), f"{name}: not a torchrec TrainPipeline"
    assert issubclass(theirs, torchrec_pipelines.TrainPipelineSparseDist), f"torchrec's {name} changed base"
    assert issubclass(ours, pipeline.TrainPipelineSparseDist), f"{name}: not our TrainPipelineSparseDist"


def test_prefetch_ems_is_an_emb_stash_as_torchrecs_is():
    assert issubclass(
        torchrec_experimental.TrainPipelinePrefetchEMS, torchrec_experimental.TrainPipelineSparseDistEmbStash
    ), "torchrec's PrefetchEMS changed base"
    assert issubclass(pipeline.TrainPipelinePrefetchEMS, pipeline.TrainPipelineSparseDistEmbStash)
    # the twin: relations are not granted to every class
    assert not issubclass(pipeline.TrainPipelineSparseDistOptStash, pipeline.TrainPipelineSparseDistEmbStash)


def test_positional_arguments_land_where_torchrecs_do():
    bound = inspect.signature(pipeline.TrainPipelineSparseDistEmbStash).bind(
        "model", "opt", "cpu", "site", True, False, None, False, None, 1, False, False, False, True, "over"
    )
    assert bound.arguments["delay_stash"] is True and bound.arguments["stash_site_fqn"] == "over"
