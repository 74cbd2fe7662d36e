"""torchrec's SparseDist variants outside its package's exports, on 2 gloo ranks, bit for bit:
`TrainPipelineSparseDistLite`, `TrainPipelineSparseDistT` and `TrainEvalHybridPipelineBase`.

- Lite and T: the plain loop (table-wise and column-wise tables, distinct batches per rank and
  step), with a negative twin (one optimizer step less) that must differ; and torchrec's class of the
  same name, which runs on CPU.
- T's copy on its worker thread (one process, the copy forced off the host).
- Hybrid: training steps and two eval passes interleaved (`PHASES`): the second pass left half-way
  for training and resumed, each pass run to its end (StopIteration, and again at once on the ended
  iterator). The training outputs and parameters are the plain loop's on the training batches alone;
  each eval output is the model's own (no_grad, eval mode) for that eval batch at that point, and
  carries that batch's labels; `last_output_mode` tags every output. The negative twin: torchrec's
  own class in the same loop returns a training batch's labels among the first eval pass's outputs,
  which the same check catches. In pure training it equals torchrec's class; which batches run
  under `execute_all_batches` is torchrec's (one process).
"""

from __future__ import annotations

import itertools

import pytest

from tests.harness import pytest_timeout

SHARDINGS = ("table_wise", "column_wise")
STEPS = 8
CASES = list(itertools.product(("dlrm", "nested"), SHARDINGS))
TRAIN_CLASSES = ("TrainPipelineSparseDistLite", "TrainPipelineSparseDistT", "TrainEvalHybridPipelineBase")
THEIR_MODULE = {
    "TrainPipelineSparseDistLite": "train_pipelines",
    "TrainPipelineSparseDistT": "experimental_pipelines",
    "TrainEvalHybridPipelineBase": "experimental_pipelines",
}
TO_END = None
"""An eval phase's `calls`: `progress()` until StopIteration (the end of its iterator)."""
EVAL_PASSES = (3, 4)
"""The batches of each eval pass (each pass its own iterator)."""
PHASES = (
    ("train", None, 3),
    ("eval", 0, TO_END),  # a whole pass, then StopIteration
    ("train", None, 3),
    ("eval", 1, 2),  # half a pass: back to training mid-pass, its batches in flight
    ("train", None, 2),
    ("eval", 1, TO_END),  # the same iterator resumed: its other half, then StopIteration
    ("eval", 1, TO_END),  # the ended iterator again: StopIteration at once
    ("train", None, 2),
)
"""The hybrid loop: (mode, which eval pass, how many `progress()` calls)."""
TIMEOUT = 150
pytestmark = [pytest.mark.timeout(pytest_timeout(TIMEOUT)), pytest.mark.slow]


def theirs(name: str):
    """torchrec's class `name`, or None where the installed torchrec has none."""
    import importlib

    module = importlib.import_module(f"torchrec.distributed.train_pipeline.{THEIR_MODULE[name]}")
    return getattr(module, name, None)


def _plain(rank: int, world_size: int, name: str, kind: str, sharding: str) -> dict:
    from tests import models
    from tests.test_family import _train_case

    return _train_case(rank, name, kind, sharding, models.plain_loop)


def _against_torchrec(rank: int, world_size: int, name: str, sharding: str) -> dict:
    """Ours and torchrec's class on the same model and batches: outputs and parameters."""
    import torch

    import pipeline
    from tests import models

    runs = {}
    for who, cls in (("ours", getattr(pipeline, name)), ("torchrec", theirs(name))):
        model, opt = models.build("dlrm", sharding)
        pipe = cls(model, opt, torch.device("cpu"))
        outputs = models.run_to_end(pipe, iter(models.batches("dlrm", STEPS, rank)))
        runs[who] = (outputs, model.state_dict())
    return {
        "count": len(runs["ours"][0]),
        "equal": models.bitwise_equal(runs["ours"], runs["torchrec"]),
    }


def _hybrid_loop(rank: int, world_size: int, who: str, sharding: str, phases=PHASES) -> dict:
    """`phases` with our hybrid pipeline (or torchrec's), against the same phases run directly: per
    phase, the outputs' count, labels and mode tags, and the numbers of the whole run."""
    import torch

    import pipeline
    from tests import models

    # every phase's training batches, so that some are in flight when a shortened loop ends
    train = models.batches("dlrm", sum(n for m, _, n in PHASES if m == "train"), rank)
    passes = [models.batches("dlrm", n, rank, seed=5 + k) for k, n in enumerate(EVAL_PASSES)]
    ref, ref_opt = models.build("dlrm", sharding)
    model, opt = models.build("dlrm", sharding)
    cls = pipeline.TrainEvalHybridPipelineBase if who == "ours" else theirs("TrainEvalHybridPipelineBase")
    pipe = cls(model, opt, torch.device("cpu"))
    iterators = {None: iter(train), **{k: iter(p) for k, p in enumerate(passes)}}
    taken = dict.fromkeys(iterators, 0)  # batches of each iterator the reference has run
    got: dict[str, list] = {"train": [], "eval": [], "expected_train": [], "expected_eval": []}
    report = []
    for i, (mode, source, calls) in enumerate(phases):
        data = train if source is None else passes[source]
        model.train(mode == "train")  # as torchrec's users switch
        outputs, tags, stopped = _progress(pipe, iterators[source], calls)
        model.train()
        expected = data[taken[source] : taken[source] + len(outputs) if calls is not TO_END else None]
        taken[source] += len(expected)
        if mode == "train":
            got["expected_train"] += models.plain_loop(ref, ref_opt, expected)
        else:
            ref.eval()
            with torch.no_grad():
                got["expected_eval"] += [ref(b)[1] for b in expected]
            ref.train()
        got[mode] += outputs
        report.append(
            {
                "phase": _phase_name(i),
                "count": (len(outputs), len(expected) if calls is TO_END else calls),
                "stopped": stopped == (calls is TO_END),
                "labels": len(outputs) == len(expected)
                and all(torch.equal(o[2], b.labels) for o, b in zip(outputs, expected, strict=True)),
                "tags": tags == [mode] * len(outputs),
            }
        )
    return {
        "phases": report,
        "train": models.bitwise_equal(got["expected_train"], got["train"]),
        "eval": models.bitwise_equal(got["expected_eval"], got["eval"]),
        "params": models.bitwise_equal(ref.state_dict(), model.state_dict()),
    }


def _phase_name(i: int) -> str:
    mode, source, calls = PHASES[i]
    return f"{i} ({mode}, {'training' if source is None else f'pass {source}'}, {calls or 'to the end'})"


def _progress(pipe, it, calls: int | None) -> tuple[list, list, bool]:
    """`calls` calls of `pipe.progress(it)` (TO_END: until StopIteration, at most 100): the outputs,
    `last_output_mode` after each, and whether StopIteration was raised."""
    outputs, tags = [], []
    for _ in range(calls if calls is not TO_END else 100):
        try:
            outputs.append(pipe.progress(it))
        except StopIteration:
            return outputs, tags, True
        tags.append(getattr(pipe, "last_output_mode", None))
    return outputs, tags, False


def _on_ranks(rank: int, world_size: int, fn, *args):
    return fn(rank, *args)


@pytest.mark.parametrize("name", ["TrainPipelineSparseDistLite", "TrainPipelineSparseDistT"])
@pytest.mark.parametrize(("kind", "sharding"), CASES)
def test_equals_plain_loop(pool, name, kind, sharding):
    from tests.test_family import _check_trained

    for rank, r in enumerate(pool.run(_plain, name, kind, sharding, timeout=TIMEOUT)):
        _check_trained(r, rank, f"the plain loop ({name}, {kind}, {sharding})")


@pytest.mark.parametrize("name", TRAIN_CLASSES)
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_equals_torchrecs_own_class(pool, name, sharding):
    if theirs(name) is None:
        pytest.skip(f"torchrec {_torchrec_version()} has no {name}")
    for rank, r in enumerate(pool.run(_against_torchrec, name, sharding, timeout=TIMEOUT)):
        where = f"{name}, dlrm {sharding}, rank {rank}"
        assert r["count"] == STEPS, f"{where}: {r['count']} outputs"
        assert r["equal"], f"{where}: outputs or parameters differ from torchrec's class"


@pytest.mark.parametrize("sharding", SHARDINGS)
def test_hybrid_interleaved_train_and_eval_outputs_are_labelled_right(pool, sharding):
    for rank, r in enumerate(pool.run(_hybrid_loop, "ours", sharding, timeout=TIMEOUT)):
        for p in r["phases"]:
            where = f"hybrid, dlrm {sharding}, rank {rank}, phase {p['phase']}"
            assert p["count"][0] == p["count"][1], f"{where}: {p['count'][0]} outputs, not {p['count'][1]}"
            assert p["stopped"], f"{where}: StopIteration where it should not be, or none at the end"
            assert p["labels"], f"{where}: an output with another batch's labels"
            assert p["tags"], f"{where}: an output tagged with the other mode (last_output_mode)"
        where = f"hybrid, dlrm {sharding}, rank {rank}"
        assert r["train"], f"{where}: training outputs differ from the plain loop on the training batches"
        assert r["eval"], f"{where}: eval outputs differ from the model's own at that point"
        assert r["params"], f"{where}: parameters differ from the plain loop (an eval batch trained?)"


def test_torchrecs_hybrid_mislabels_in_the_same_loop(pool):
    """The negative twin of the test above: the same check fails on torchrec's class (in the first
    two phases: a training run, then an eval pass to its end)."""
    if theirs("TrainEvalHybridPipelineBase") is None:
        pytest.skip(f"torchrec {_torchrec_version()} has no TrainEvalHybridPipelineBase")
    results = pool.run(_hybrid_loop, "torchrec", "table_wise", PHASES[:2], timeout=TIMEOUT)
    for rank, r in enumerate(results):
        # the first eval pass begins with the training batches that were in flight
        assert not r["phases"][1]["labels"], (
            f"rank {rank}: torchrec's hybrid labelled the first eval pass right"
        )


def _torchrec_version() -> str:
    from importlib.metadata import version

    return version("torchrec")


# -- one process: which batches run, and T's copy thread ----------------------------------------


@pytest.mark.parametrize("execute_all_batches", [True, False])
@pytest.mark.parametrize("training", [True, False])
def test_hybrid_runs_the_batches_torchrecs_runs(execute_all_batches, training):
    """Training: torchrec's rule. An eval pass runs every batch, as torchrec documents ("continues
    processing remaining eval batches"); under `execute_all_batches=False` torchrec's class drops
    the pass's last batch (its `fill_pipeline` refills once the pass's queue is down to one
    batch, and the copy raises StopIteration), which ours does not copy."""
    import pipeline

    for n in range(9):
        ours = _schedule(pipeline.TrainEvalHybridPipelineBase, n, training, execute_all_batches)
        torchrecs = _schedule(theirs("TrainEvalHybridPipelineBase"), n, training, execute_all_batches)
        if training or execute_all_batches:
            assert ours == torchrecs, f"{n} batches, training={training}"
        else:
            assert ours == list(range(n)), f"{n} batches in an eval pass: {ours}"
            assert len(torchrecs) == (n - 1 if n > 1 else 0), torchrecs
        assert ours == list(range(len(ours)))


def _schedule(cls, n: int, training: bool, execute_all_batches: bool) -> list[int]:
    """The positions of the batches whose outputs `cls` returns, the model in `training` mode."""
    import torch

    from tests import models
    from tests.test_torchrec_parity import _Echo, _Numbered

    model = _Echo()
    model.train(training)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    pipe = cls(model, optimizer, torch.device("cpu"), execute_all_batches=execute_all_batches)
    return [int(out) for out in models.run_to_end(pipe, iter([_Numbered(i) for i in range(n)]))]


def test_copy_thread_dispatches_device_copies_on_its_worker():
    """T off the host (forced here on CPU): every copy after the fill runs on the worker thread,
    and each batch is taken from it before its first use."""
    import threading

    import torch

    import pipeline
    from tests import models
    from tests.test_torchrec_parity import _Echo, _Numbered

    class Traced(_Numbered):
        def to(self, device: torch.device, non_blocking: bool = False):
            threads.append(threading.current_thread().name)
            return self

    for name, on_worker in (("TrainPipelineSparseDistT", True), ("TrainPipelineSparseDist", False)):
        threads: list[str] = []
        model = _Echo()
        pipe = getattr(pipeline, name)(
            model, torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu")
        )
        pipe._on_host = False  # copy as if to a device
        outputs = models.run_to_end(pipe, iter([Traced(i) for i in range(6)]))
        assert [int(o) for o in outputs] == list(range(6)), name
        workers = [t.startswith("pipeline-copy") for t in threads]
        assert workers == [False, False] + [on_worker] * 4, f"{name}: copies ran on {threads}"
