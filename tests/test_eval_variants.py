"""torchrec's eval pipelines outside its package's exports, on 2 gloo ranks, bit for bit:
`EvalPipelineFusedSparseDist` and `EvalPipelineCPUSparse`. torchrec's own classes do not run on CPU
(the first dies on a CPU stream's missing `.device`, the second on pinned memory), so the reference
is their documented semantics, written here: each output is the model's own output for that batch
(`model(batch)` under `no_grad`, in the model's mode), and nothing changes (parameters, gradients).

Table-wise and column-wise tables, distinct batches per rank, every option that changes the order
of the stages (the lookup ahead or after the next batch's input_dist; pipeline depth 1 or 2; the
sparse stage on a worker thread), the model in eval and in training mode; one output per batch, then
StopIteration; every call site pipelined (the rewrite report). The negative twin: the outputs one
batch off must differ. Also, for all five of torchrec 1.9's unexported classes: the stream hand-offs
on `RecordingStreams`, with a broken twin; and (one process) torchrec's constructor parameters, in
its order with its defaults, and torchrec's base classes (skipped where the installed torchrec lacks
the class).
"""

from __future__ import annotations

import contextlib
import itertools

import pytest

from tests.harness import pytest_timeout

SHARDINGS = ("table_wise", "column_wise")
STEPS = 7
SITES = {"dlrm": 1, "nested": 2}
"""The sharded modules' call sites of each model kind (one call each): all must be pipelined."""
FUSED_OPTIONS = {
    "": {},
    "prefetch": {"enable_embedding_lookup_prefetch": True},
    "after": {"embedding_lookup_after_data_dist": True, "emb_lookup_stream": "current"},
    "late-copy": {"enqueue_batch_after_forward": True, "enable_embedding_lookup_prefetch": True},
}
CPU_OPTIONS = {
    "depth2": {},
    "depth1": {"pipeline_depth": 1},
    "thread": {"multi_thread": True},
    "thread-depth1": {"multi_thread": True, "pipeline_depth": 1},
}
FUSED_CASES = [
    ("EvalPipelineFusedSparseDist", k, s, o, "eval")
    for k, s, o in itertools.product(("dlrm", "nested"), SHARDINGS, FUSED_OPTIONS)
]
CPU_CASES = [
    ("EvalPipelineCPUSparse", k, s, o, "eval")
    for k, s, o in itertools.product(("dlrm", "nested"), SHARDINGS, CPU_OPTIONS)
]
CPU_CASES += [  # data-parallel tables: no collective in the sparse stage, which may leave the thread
    ("EvalPipelineCPUSparse", k, "data_parallel", o, "eval")
    for k, o in (("dlrm", "thread"), ("nested", "thread-depth1"), ("dlrm", "depth1"))
]
TRAIN_MODE_CASES = [
    ("EvalPipelineFusedSparseDist", "dlrm", "column_wise", "prefetch", "train"),
    ("EvalPipelineCPUSparse", "nested", "table_wise", "depth2", "train"),
]
OPTIONS = {"EvalPipelineFusedSparseDist": FUSED_OPTIONS, "EvalPipelineCPUSparse": CPU_OPTIONS}
TIMEOUT = 150
pytestmark = [pytest.mark.timeout(pytest_timeout(TIMEOUT)), pytest.mark.slow]


def _eval_case(rank: int, world_size: int, name: str, kind: str, sharding: str, option: str, mode: str):
    import torch

    import pipeline
    from tests import models

    ref, _ = models.build(kind, sharding)
    ref.train(mode == "train")
    with torch.no_grad():
        expected = [ref(b)[1] for b in models.batches(kind, STEPS, rank)]
    model, opt = models.build(kind, sharding)
    before = [t.clone() for t in models.flat_tensors(model.state_dict())]
    model.train(mode == "train")
    pipe = getattr(pipeline, name)(model, opt, torch.device("cpu"), **OPTIONS[name][option])
    with _lookup_threads() as threads:
        outputs, stopped = models.outputs_then_stop(pipe, iter(models.batches(kind, STEPS, rank)), STEPS)
    return {
        "outputs": models.bitwise_equal(expected, outputs),
        "shifted": models.bitwise_equal(expected[1:], outputs[:-1]),
        "params": models.bitwise_equal(before, models.flat_tensors(model.state_dict())),
        "no_grad": all(p.grad is None for p in model.parameters()),
        "stopped": stopped,
        "sites": [(s.key, m.pipelined) for m in pipe.rewrite_report.modules for s in m.sites],
        "report": str(pipe.rewrite_report),
        "notes": list(pipe.rewrite_report.notes),
        "on_worker": sum(t.startswith("pipeline-sparse") for t in threads),
    }


@contextlib.contextmanager
def _lookup_threads():
    """The names of the threads each lookup stage ran on, while inside."""
    import threading
    from unittest import mock

    from pipeline.stages.lookup import LookupStage

    threads: list[str] = []
    run = LookupStage.run

    def traced(self, ctx):
        threads.append(threading.current_thread().name)
        return run(self, ctx)

    with mock.patch.object(LookupStage, "run", traced):
        yield threads


@pytest.mark.parametrize(
    ("name", "kind", "sharding", "option", "mode"), FUSED_CASES + CPU_CASES + TRAIN_MODE_CASES
)
def test_outputs_are_the_models_own(pool, name, kind, sharding, option, mode):
    results = pool.run(_eval_case, name, kind, sharding, option, mode, timeout=TIMEOUT)
    for rank, r in enumerate(results):
        where = f"{name} ({option or 'default'}), {kind} {sharding}, model in {mode} mode, rank {rank}"
        pipelined = [key for key, ok in r["sites"] if ok]
        assert len(pipelined) == len(r["sites"]) == SITES[kind], f"{where}: call sites\n{r['report']}"
        assert r["stopped"], f"{where}: no StopIteration after {STEPS} outputs"
        assert r["outputs"], f"{where}: outputs differ from the model's own"
        assert not r["shifted"], f"{where}: batches are not distinct: the comparison cannot fail"
        assert r["params"], f"{where}: parameters changed"
        assert r["no_grad"], f"{where}: gradients were computed"
        noted = any("multi_thread" in note for note in r["notes"])
        if option.startswith("thread") and sharding == "data_parallel":
            assert r["on_worker"] >= STEPS - 2 and not noted, f"{where}: sparse stage not on the worker"
        elif option.startswith("thread"):  # table-wise and column-wise tables communicate
            assert noted and r["on_worker"] == 0, f"{where}: {r['on_worker']} on the worker, {r['notes']}"
        else:
            assert r["on_worker"] == 0, f"{where}: the sparse stage ran on a worker thread"


# -- stream hand-offs on RecordingStreams --------------------------------------------------------

_DIST = ("copy", "input_dist::start", "input_dist::splits")
_TRAIN = (*_DIST, "forward", "backward", "optimizer")
STAGES_OF = {
    "TrainPipelineSparseDistLite": _TRAIN,
    "TrainPipelineSparseDistT": _TRAIN,
    "TrainEvalHybridPipelineBase": _TRAIN,
    "EvalPipelineFusedSparseDist": (*_DIST, "lookup", "forward"),
    "EvalPipelineCPUSparse": ("copy",),  # the device's stages; the sparse stage is on the host
}
STREAM_OF = {
    "copy": "memcpy",
    "input_dist::start": "data_dist",
    "input_dist::splits": "data_dist",
    "lookup": "data_dist",
    "forward": "default",
    "backward": "default",
    "optimizer": "default",
}


def _streams_case(rank: int, world_size: int, name: str, broken: bool) -> dict:
    import torch

    import pipeline
    from tests import models

    model, opt = models.build("dlrm", "table_wise")
    result, _ = models.recorded_run(
        lambda streams: getattr(pipeline, name)(model, opt, torch.device("cpu"), streams=streams),
        models.batches("dlrm", STEPS, rank, seed=9),
        broken=broken,
    )
    return result


@pytest.mark.parametrize("name", STAGES_OF)
def test_stream_hand_offs(pool, name):
    correct = pool.run(_streams_case, name, False, timeout=TIMEOUT)
    broken = pool.run(_streams_case, name, True, timeout=TIMEOUT)
    for rank, (r, b) in enumerate(zip(correct, broken, strict=True)):
        where = f"{name}, rank {rank}"
        assert r["outputs"] == STEPS and r["error"] is None, f"{where}: {r}"
        # at least the batch per batch, and the embeddings where they are handed off separately
        assert r["checked"] >= (2 if name == "EvalPipelineCPUSparse" else 1) * STEPS, f"{where}: {r}"
        expected = {stage: [STREAM_OF[stage]] for stage in STAGES_OF[name]}
        assert r["stages"] == expected, f"{where}: stages on {r['stages']}"
        runs = r["runs"]
        runs.pop("input_dist::splits", None)  # re-entered while waiting: at least once a batch
        assert runs == {s: STEPS for s in STAGES_OF[name] if s != "input_dist::splits"}, f"{where}: {runs}"
        assert b["error"] and "without a wait" in b["error"], f"{where}, a hand-off without a wait: {b}"


# -- constructors and bases against torchrec's classes (one process) ---------------------------

THEIR_MODULE = {
    "TrainPipelineSparseDistLite": "train_pipelines",
    "TrainPipelineSparseDistT": "experimental_pipelines",
    "TrainEvalHybridPipelineBase": "experimental_pipelines",
    "EvalPipelineFusedSparseDist": "train_pipelines",
    "EvalPipelineCPUSparse": "experimental_pipelines",
}
LATER_TORCHREC = {"async_inplace_copy"}
"""What torchrec 1.9 added (Lite, Hybrid): ours declares it in 1.9's place, also under 1.8."""


def _theirs(name: str):
    """torchrec's class `name`, or None where the installed torchrec has none."""
    import importlib

    return getattr(
        importlib.import_module(f"torchrec.distributed.train_pipeline.{THEIR_MODULE[name]}"), name, None
    )


def _their_parameters(cls: type) -> list:
    """torchrec's constructor parameters; for a `*args, **kwargs` constructor (EvalFused over
    Fused), its base's, then its own keyword-only ones."""
    import inspect

    params = list(inspect.signature(cls).parameters.values())
    if params and params[0].kind is inspect.Parameter.VAR_POSITIONAL:
        own = [p for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
        return _their_parameters(cls.__mro__[1]) + own
    return params


@pytest.mark.parametrize("name", THEIR_MODULE)
def test_constructor_takes_torchrecs_parameters_in_order_with_its_defaults(name):
    import inspect

    import pipeline

    theirs = _theirs(name)
    if theirs is None:
        pytest.skip(f"this torchrec has no {name}")
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    ours = list(inspect.signature(getattr(pipeline, name)).parameters.values())
    their_params = _their_parameters(theirs)
    our_positional = [p.name for p in ours if p.kind is positional]
    their_positional = [p.name for p in their_params if p.kind is positional]
    assert our_positional[: len(their_positional)] == their_positional, f"{name}: {our_positional}"
    assert set(our_positional[len(their_positional) :]) <= LATER_TORCHREC, f"{name}: {our_positional}"
    by_name = {p.name: p for p in ours}
    for p in their_params:
        mine = by_name.get(p.name)
        assert mine is not None and mine.kind is p.kind, f"{name}.{p.name}: {mine} for torchrec's {p}"
        # the context class default: each package's class of that name
        expected = getattr(pipeline, p.default.__name__) if p.name == "context_type" else p.default
        assert mine.default == expected, (
            f"{name}.{p.name}: default {mine.default!r}, torchrec's {p.default!r}"
        )
    known = {p.name for p in their_params} | LATER_TORCHREC
    extras = [p.name for p in ours if p.name not in known and p.kind is not inspect.Parameter.KEYWORD_ONLY]
    assert extras == [], f"{name}: our own parameters must be keyword-only: {extras}"


@pytest.mark.parametrize("name", THEIR_MODULE)
def test_subclass_of_what_torchrecs_class_derives_from(name):
    import pipeline

    theirs = _theirs(name)
    if theirs is None:
        pytest.skip(f"this torchrec has no {name}")
    from torchrec.distributed.train_pipeline import TrainPipeline

    ours = getattr(pipeline, name)
    bases = [b.__name__ for b in theirs.__mro__[1:] if b.__name__.startswith("TrainPipeline")]
    assert "TrainPipeline" in bases, f"torchrec's {name} derives from {bases}"
    for base in bases:
        assert issubclass(ours, getattr(pipeline, base)), f"{name} is no {base}"
    assert issubclass(ours, TrainPipeline), f"{name} is no torchrec TrainPipeline"
