"""Our pipeline classes have torchrec's class tree: each derives from the classes torchrec's derives
from (computed from the installed torchrec), by inheritance, not ABC `register`, so that a user's
subclass or a patched method of a parent reaches the children as it does in torchrec. One process,
no ranks: a model without sharded modules, whose loss counts each batch's position.
"""

from __future__ import annotations

import abc
import importlib
import inspect

import pytest
import torch
from torchrec.distributed.train_pipeline import train_pipelines as torchrec_pipelines

import pipeline
from tests import models
from tests.test_torchrec_parity import _Echo, _Numbered

MODULES = ("train_pipelines", "experimental_pipelines", "pec_train_pipeline")


def _torchrec_classes() -> dict[str, type]:
    """torchrec's public classes of its pipeline modules, by name (defined there, not imported)."""
    found = {}
    for name in MODULES:
        try:
            module = importlib.import_module(f"torchrec.distributed.train_pipeline.{name}")
        except ImportError:  # pec_train_pipeline came with torchrec 1.9
            continue
        for n, obj in vars(module).items():
            if inspect.isclass(obj) and obj.__module__ == module.__name__ and not n.startswith("_"):
                found[n] = obj
    return found


TORCHREC = _torchrec_classes()
SPARSE_DIST_FAMILY = sorted(
    n
    for n, c in TORCHREC.items()
    if issubclass(c, torchrec_pipelines.TrainPipelineSparseDist)
    and c is not torchrec_pipelines.TrainPipelineSparseDist
)
# (class, ancestor) for every ancestor torchrec's class has among the classes `pipeline` exports
PAIRS = sorted(
    (n, base.__name__)
    for n, c in TORCHREC.items()
    for base in c.__mro__[1:]
    if base.__name__ in pipeline.__all__ and base.__name__ in TORCHREC
)
HOOKS = ("_next_batch", "_backward", "_optimizer_step", "_wait_for_batch")
# Where ours does not have torchrec's own-or-inherited choice for a hook, and why it makes no
# difference to a user's patch or override of the parent's.
HOOK_EXCEPTIONS = {
    ("TrainEvalHybridPipelineBase", "_next_batch"): "torchrec's calls its parent's before the first "
    "step and then hands back a batch fetched by it: a patch of the parent's reaches both",
    ("EvalPipelineCPUSparse", "_wait_for_batch"): "torchrec's step never calls it; ours waits for the "
    "embeddings too: a patch of the parent's reaches neither",
}


def test_the_family_is_found():
    assert {
        "TrainPipelineFusedSparseDist",
        "EvalPipelineFusedSparseDist",
        "TrainPipelinePrefetchEMS",
        "TrainPipelineSparseDistLite",
        "TrainPipelineSemiSync",
    } <= set(SPARSE_DIST_FAMILY)
    assert ("EvalPipelineFusedSparseDist", "TrainPipelineFusedSparseDist") in PAIRS
    assert ("TrainPipelinePrefetchEMS", "TrainPipelineSparseDistEmbStash") in PAIRS


@pytest.mark.parametrize("name", SPARSE_DIST_FAMILY)
def test_ours_derives_from_our_sparse_dist_where_torchrecs_does(name):
    assert issubclass(getattr(pipeline, name), pipeline.TrainPipelineSparseDist)
    assert pipeline.TrainPipelineSparseDist in getattr(pipeline, name).__mro__  # inherited, not registered


@pytest.mark.parametrize(("name", "parent"), PAIRS)
def test_ours_derives_from_each_class_torchrecs_derives_from(name, parent):
    ours, our_parent = getattr(pipeline, name), getattr(pipeline, parent)
    assert our_parent in ours.__mro__, f"{name} does not inherit {parent}, as torchrec's does"


def test_no_class_is_registered_with_another():
    classes = [getattr(pipeline, n) for n in pipeline.__all__ if inspect.isclass(getattr(pipeline, n))]
    registered = {
        c.__name__: sorted(r().__name__ for r in abc._get_dump(c)[0])
        for c in classes
        if isinstance(c, abc.ABCMeta) and abc._get_dump(c)[0]
    }
    assert not registered, f"ABC register instead of inheritance: {registered}"


@pytest.mark.parametrize("name", SPARSE_DIST_FAMILY)
@pytest.mark.parametrize("hook", HOOKS)
def test_ours_inherits_a_hook_where_torchrecs_does(name, hook):
    if (name, hook) in HOOK_EXCEPTIONS:
        pytest.skip(HOOK_EXCEPTIONS[name, hook])
    theirs = getattr(TORCHREC[name], hook) is getattr(torchrec_pipelines.TrainPipelineSparseDist, hook)
    ours = getattr(getattr(pipeline, name), hook) is getattr(pipeline.TrainPipelineSparseDist, hook)
    assert ours == theirs, f"{name}.{hook}: torchrec's {'inherits' if theirs else 'overrides'} it"


# -- a patch or an override of a hook, running ---------------------------------------------------

RUNS = (
    "TrainPipelineSparseDist",
    "TrainPipelineFusedSparseDist",
    "TrainPipelineSemiSync",
    "PrefetchTrainPipelineSparseDist",
    "TrainPipelineSparseDistLite",
    "TrainEvalHybridPipelineBase",
    "TrainPipelineSparseDistT",
)
N = 6


def _run(cls: type, n: int = N) -> list[int]:
    model = _Echo()
    pipe = cls(model, torch.optim.SGD(model.parameters(), lr=0.0), torch.device("cpu"))
    return [int(out) for out in models.run_to_end(pipe, iter([_Numbered(i) for i in range(n)]))]


def _theirs(name: str) -> type:
    return TORCHREC[name]


def _backward_calls(sparse_dist: type, cls: type, monkeypatch) -> list[str]:
    """The classes whose step called `sparse_dist._backward`, patched, in a run of `cls`."""
    calls: list[str] = []
    original = sparse_dist._backward

    def counting(self, losses):
        calls.append(type(self).__name__)
        original(self, losses)

    with monkeypatch.context() as patch:
        patch.setattr(sparse_dist, "_backward", counting)
        _run(cls)
    return calls


@pytest.mark.parametrize("name", RUNS)
def test_a_patch_of_sparse_dists_backward_reaches_the_subclass(name, monkeypatch):
    ours = _backward_calls(pipeline.TrainPipelineSparseDist, getattr(pipeline, name), monkeypatch)
    theirs = _backward_calls(torchrec_pipelines.TrainPipelineSparseDist, _theirs(name), monkeypatch)
    # torchrec's SemiSync and Prefetch run backward without calling `_backward`; ours honour it in
    # every class, so ours reach at least where torchrec's do, once per trained batch
    assert ours == [name] * N
    assert not theirs or theirs == ours


def _skip_odd(self, dataloader_iter):
    batch = next(dataloader_iter, None)
    return next(dataloader_iter, None) if batch is not None and int(batch.x) % 2 else batch


@pytest.mark.parametrize("name", RUNS)
def test_a_users_subclass_overriding_next_batch_runs_as_torchrecs(name):
    ours = _run(type("UserPipeline", (getattr(pipeline, name),), {"_next_batch": _skip_odd}))
    theirs = _run(type("UserPipeline", (_theirs(name),), {"_next_batch": _skip_odd}))
    assert ours == [0, 2, 4]
    assert ours == theirs


def test_a_users_parent_override_reaches_the_chain(monkeypatch):
    """A hook patched on our TrainPipelineSparseDist reaches Fused and, through it, EvalFused's
    parent chain; one patched on Fused does not reach SparseDist (as in torchrec)."""
    calls = _backward_calls(
        pipeline.TrainPipelineFusedSparseDist, pipeline.TrainPipelineSparseDist, monkeypatch
    )
    assert calls == []
    calls = _backward_calls(
        pipeline.TrainPipelineSparseDist, pipeline.TrainPipelineFusedSparseDist, monkeypatch
    )
    assert calls == ["TrainPipelineFusedSparseDist"] * N
