"""Every public name of torchrec's `torchrec.distributed.train_pipeline` package (the same names in
1.8 and 1.9) is in `pipeline`, and each of ours is usable where torchrec's is: one small behavioural
check per name, against torchrec's own object where it runs here. One process, no ranks (the
pipelines' numbers are the equivalence tests'; constructors, class by class, are
tests/test_compat.py's; the classes of torchrec's five pipeline modules that its package does not
export are enumerated in tests/test_torchrec_modules.py).
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import types
from typing import TypeVar

import pytest
import torch
from torch import fx, nn
from torchrec.distributed import train_pipeline as torchrec_pipeline

import pipeline

TORCHREC_NAMES = sorted(
    n
    for n in dir(torchrec_pipeline)
    if not n.startswith("_") and not isinstance(getattr(torchrec_pipeline, n), types.ModuleType)
)


def test_torchrec_exports_the_names_this_test_knows():
    # 22 names (19 besides the type variables): a new one must get a check below
    assert sorted(CHECKS) == TORCHREC_NAMES


@pytest.mark.parametrize("name", TORCHREC_NAMES)
def test_pipeline_exports_it(name):
    assert name in pipeline.__all__, f"pipeline does not export torchrec's {name}"
    assert getattr(pipeline, name) is not None


@pytest.mark.parametrize("name", TORCHREC_NAMES)
def test_ours_is_usable_as_torchrecs(name):
    CHECKS[name](getattr(pipeline, name), getattr(torchrec_pipeline, name))


# -- the checks ----------------------------------------------------------------------------------


def _parameters(obj) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(obj).parameters.values()]


def _same_signature(ours, theirs) -> None:
    assert _parameters(ours) == _parameters(theirs)


def _takes_torchrecs_parameters(ours, theirs) -> None:
    """torchrec's parameters, in its order, then ours (defaults: tests/test_compat.py)."""
    names = [n for n, _ in _parameters(theirs)]
    assert [n for n, _ in _parameters(ours)][: len(names)] == names


def _pipeline_class(ours, theirs) -> None:
    """A torchrec TrainPipeline taking torchrec's parameters."""
    assert issubclass(ours, torchrec_pipeline.TrainPipeline)
    _takes_torchrecs_parameters(ours, theirs)


def _train_pipeline(ours, theirs) -> None:
    assert ours is theirs  # the abstract base is torchrec's: isinstance() answers as torchrec's
    assert all(issubclass(getattr(pipeline, n), ours) for n in _PIPELINES if hasattr(pipeline, n))


def _type_var(ours, theirs) -> None:
    assert isinstance(ours, TypeVar) and ours is theirs  # our classes are generic through torchrec's


def _config(ours, theirs) -> None:
    """Same fields and defaults; the same values after the same arguments."""
    _same_signature(ours, theirs)
    for args in ({}, {"num_steps": 3}, {"num_steps": 2, "num_warmup_steps": 4}):
        assert dataclasses.astuple(ours(**args)) == dataclasses.astuple(theirs(**args))
    for bad in ({"num_steps": 0}, {"num_warmup_steps": 0}):
        with pytest.raises(ValueError):
            theirs(**bad)
        with pytest.raises(ValueError):
            ours(**bad)


class _Optimizer:
    def __init__(self) -> None:
        self.steps = self.zero_grads = 0

    def step(self) -> None:
        self.steps += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.zero_grads += 1


class _CountingPipeline:
    """Calls zero_grad and step of its optimizer once a batch, as a pipeline does."""

    def __init__(self, optimizer) -> None:
        self._optimizer = optimizer

    def progress(self, it):
        batch = next(it)
        self._optimizer.zero_grad()
        self._optimizer.step()
        return batch


def _wrapper(ours, theirs) -> None:
    """The same steps and zero_grads for 11 batches in groups of 4 (the last one unfinished)."""
    assert [n for n, _ in _parameters(ours)] == [n for n, _ in _parameters(theirs)]
    counts = []
    for wrapper, config in (
        (ours, pipeline.GradientAccumulationConfig),
        (theirs, torchrec_pipeline.GradientAccumulationConfig),
    ):
        opt = _Optimizer()
        wrapped = wrapper(_CountingPipeline(opt), opt, nn.Linear(1, 1), config(num_steps=4))
        it = iter(range(11))
        outputs = []
        with pytest.raises(StopIteration):
            while True:
                outputs.append(wrapped.progress(it))
        counts.append((outputs, opt.steps, opt.zero_grads))
    # steps after batches 3 and 7 and at the end; zero_grad before batches 0, 4, 8 and at the end
    assert counts[0] == counts[1] == (list(range(11)), 3, 4)


def _context(ours, theirs) -> None:
    """A dataclass with torchrec's `index` and `module_contexts`, taken as `context_type`."""
    common = {"index", "module_contexts"}
    assert common <= {f.name for f in dataclasses.fields(ours)} & {f.name for f in dataclasses.fields(theirs)}
    pipe = pipeline.TrainPipelineSparseDist(nn.Linear(1, 1), None, torch.device("cpu"), context_type=ours)
    assert isinstance(pipe, pipeline.TrainPipelineSparseDist)


class _Features:
    def __init__(self) -> None:
        self.sparse = {"user": torch.arange(3), "item": [torch.ones(2), torch.zeros(1)]}
        self.dense = torch.rand(2, 2)


def _arg_infos(module):
    """The same ArgInfos built with `module`'s (ours or torchrec's) factory."""
    f = module.ArgInfoStepFactory
    double = nn.Identity()
    return [
        module.ArgInfo([f.get_attr("sparse"), f.get_item("user")]),
        module.ArgInfo([f.get_attr("sparse"), f.get_item("item"), f.get_item(1)]),
        module.ArgInfo([f.noop()]),
        module.ArgInfo([f.from_scalar(7)]),
        module.ArgInfo([f.get_attr("dense"), f.postproc(double)]),
        module.ArgInfo([f.from_list([module.ArgInfo([f.get_attr("dense")]), 5])]),
        module.ArgInfo([f.from_dict({"d": module.ArgInfo([f.get_attr("dense")]), "n": None})]),
        module.ArgInfo([]).add_step(f.get_item("user")).add_step(f.get_attr("sparse")),
        module.ArgInfo([]).append_step(f.get_attr("sparse")).append_step(f.get_item("user")),
        module.ArgInfo([]),  # no steps: None, in both
    ]


def _same_values(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same_values, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_values(a[k], b[k]) for k in a)
    return a is b or (a == b and type(a) is type(b))


def _arg_info(ours, theirs) -> None:
    """Every kind of step gives torchrec's value; a path of attributes and items is a path of ours."""
    assert [f.name for f in dataclasses.fields(ours)] == [f.name for f in dataclasses.fields(theirs)]
    batch = _Features()
    ours_infos, theirs_infos = _arg_infos(pipeline), _arg_infos(torchrec_pipeline)
    for mine, torchrecs in zip(ours_infos, theirs_infos, strict=True):
        assert _same_values(mine.process_steps(batch), torchrecs.process_steps(batch)), torchrecs
    assert ours_infos[7] == ours_infos[0] and ours_infos[8] == ours_infos[0]
    path = ours_infos[1].to_path()
    assert str(path) == "batch.sparse['item'][1]" and torch.equal(
        path.resolve(batch), batch.sparse["item"][1]
    )


def _call_args(ours, theirs) -> None:
    assert [f.name for f in dataclasses.fields(ours)] == [f.name for f in dataclasses.fields(theirs)]
    batch = _Features()
    built = []
    for module, cls in ((pipeline, ours), (torchrec_pipeline, theirs)):
        infos = _arg_infos(module)
        built.append(cls(args=infos[:2], kwargs={"x": infos[3], "y": infos[5]}).build_args_kwargs(batch))
    assert _same_values(built[0], built[1])


def _step_factory(ours, theirs) -> None:
    methods = [m for m in dir(theirs) if not m.startswith("_")]
    assert methods == [m for m in dir(ours) if not m.startswith("_")]
    for m in methods:
        assert [n for n, _ in _parameters(getattr(ours, m))] == [
            n for n, _ in _parameters(getattr(theirs, m))
        ]


class _Leafy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        self.b = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))

    def forward(self, x):
        return self.b(self.a(x))


def _tracer(ours, theirs) -> None:
    """The same leaves as torchrec's tracer, for each way of naming them."""
    _same_signature(ours, theirs)
    assert issubclass(ours, fx.Tracer)
    for leaves, extend in itertools.product((None, ["a"], ["b", "b.1"]), (False, True)):
        calls = []
        for tracer in (ours(leaves, extend), theirs(leaves, extend)):
            graph = tracer.trace(_Leafy())
            calls.append([n.target for n in graph.nodes if n.op == "call_module"])
        assert calls[0] == calls[1], (leaves, extend, calls)


class _Loader:
    """Batches 0..n-1; an error (retryable or not) in place of the batches listed."""

    def __init__(self, n: int, errors: dict[int, Exception]) -> None:
        self.n, self.errors, self.i = n, errors, 0

    def __iter__(self):
        return self

    def __next__(self):
        i, self.i = self.i, self.i + 1
        if i in self.errors:
            raise self.errors[i]
        if i >= self.n:
            raise StopIteration
        return torch.full((2,), float(i))


def _retryable() -> Exception:
    error = RuntimeError("flaky read")
    error.is_retryable = True
    return error


def _drain(thread_cls, loader) -> list:
    """What `get_next_batch()` gives until None (an error as its repr), then once more."""
    thread = thread_cls(torch.device("cpu"), loader, False)
    thread.start()
    got = []
    try:
        while True:
            try:
                batch = thread.get_next_batch()
            except RuntimeError as e:
                got.append(repr(e))
                continue
            got.append(None if batch is None else batch.tolist())
            if batch is None:
                got.append(thread.get_next_batch())
                return got
    finally:
        thread.stop()
        if thread_cls is pipeline.DataLoadingThread:
            thread.join(5)  # torchrec 1.8's cannot be joined: its `_stop` flag hides Thread._stop()


def _data_loading_thread(ours, theirs) -> None:
    """The same batches, in order, as torchrec's thread: to the end, past a retryable error, up to a
    fatal one; StopIteration with none_throws; never more than one batch read ahead."""
    _same_signature(ours, theirs)
    for n, errors in ((5, {}), (5, {2: _retryable()}), (5, {3: RuntimeError("bad shard")})):
        assert _drain(ours, _Loader(n, errors)) == _drain(theirs, _Loader(n, errors)), (n, errors)
    loader = _Loader(3, {})
    thread = ours(torch.device("cpu"), loader, True)
    thread.start()
    assert thread.get_next_batch().tolist() == [0.0, 0.0]
    thread.join(0.2)
    assert loader.i <= 2  # batch 1 loaded ahead, batch 2 not read
    assert thread.get_next_batch(none_throws=True).tolist() == [1.0, 1.0]
    thread.get_next_batch()
    with pytest.raises(StopIteration):
        thread.get_next_batch(none_throws=True)
    thread.join(5)
    assert not thread.is_alive() and thread.daemon


def _compile_config(ours, theirs) -> None:
    _same_signature(ours, theirs)
    assert dataclasses.astuple(ours()) == dataclasses.astuple(theirs())


_PIPELINES = (
    "TrainPipelineBase",
    "TrainPipelineSparseDist",
    "PrefetchTrainPipelineSparseDist",
    "TrainPipelineFusedSparseDist",
    "EvalPipelineSparseDist",
    "TrainPipelinePT2",
    "TrainPipelineSparseDistCompAutograd",
)

CHECKS = {
    **dict.fromkeys(_PIPELINES, _pipeline_class),
    "StagedTrainPipeline": _pipeline_class,
    "SparseDataDistUtil": _takes_torchrecs_parameters,
    "TrainPipeline": _train_pipeline,
    "In": _type_var,
    "Out": _type_var,
    "StageOut": _type_var,
    "GradientAccumulationConfig": _config,
    "GradientAccumulationWrapper": _wrapper,
    "TrainPipelineContext": _context,
    "ArgInfo": _arg_info,
    "CallArgs": _call_args,
    "ArgInfoStepFactory": _step_factory,
    "Tracer": _tracer,
    "DataLoadingThread": _data_loading_thread,
    "TorchCompileConfig": _compile_config,
}
