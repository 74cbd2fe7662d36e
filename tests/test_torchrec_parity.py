"""Parity with torchrec's own pipeline classes where they used to differ.

1. `execute_all_batches=False`: for every dataloader length, each pipeline returns the outputs of the
   same batches as torchrec's class of the same name, and drops the same ones; except the Prefetch
   pipeline, which follows torchrec's fixed rule (N-2 outputs of N batches, as SparseDist), not
   torchrec 1.8.0's N-4 (its `fill_pipeline` refills from the second step: docs/reference.md,
   "`execute_all_batches=False`").
   torchrec's Prefetch pipeline needs a CUDA stream to run a sharded module, so its schedule is
   taken on a model without one (the schedule does not depend on the modules); torchrec's
   SparseDist and Base also run on the sharded model over gloo.
2. Postprocs called with lists, tuples and dicts of batch values (`pipeline_postproc=True`).

Both on 2 gloo ranks against the plain loop, bit for bit, one scenario a test on the module's ranks;
the schedule table also in one process.
"""

from __future__ import annotations

from importlib.metadata import version

import pytest
import torch
from torch import nn
from torchrec.distributed import train_pipeline as torchrec_pipelines
from torchrec.streamable import Pipelineable

import pipeline
from tests import models
from tests.harness import pytest_timeout

PIPELINES = ("TrainPipelineBase", "TrainPipelineSparseDist", "PrefetchTrainPipelineSparseDist")
# torchrec 1.9 fixed the guard of Prefetch's `fill_pipeline` (2 batches queued, not 3): N-2 outputs.
TORCHREC_PREFETCH_FIXED = tuple(int(part) for part in version("torchrec").split(".")[:2]) >= (1, 9)
LENGTHS = (0, 1, 2, 3, 4, 5, 9)
TIMEOUT = 120
pytestmark = [pytest.mark.timeout(pytest_timeout(TIMEOUT)), pytest.mark.slow]


# -- the schedule alone: a model without sharded modules ---------------------------------------


class _Numbered(Pipelineable):
    """A batch that carries its position in the dataloader."""

    def __init__(self, index: int) -> None:
        self.x = torch.full((1, 1), float(index))

    def to(self, device: torch.device, non_blocking: bool = False) -> _Numbered:
        return self

    def record_stream(self, stream) -> None:
        pass


class _Echo(nn.Module):
    """Returns (loss, the batch's position)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1, 1))

    def forward(self, batch: _Numbered):
        return (batch.x * self.w).sum(), batch.x.squeeze()


def schedule(cls: type, n: int, **options) -> list[int]:
    """The positions of the batches whose outputs `cls` returns from a dataloader of `n` batches."""
    model = _Echo()
    pipe = cls(model, torch.optim.SGD(model.parameters(), lr=0.0), torch.device("cpu"), **options)
    return [int(out) for out in models.run_to_end(pipe, iter([_Numbered(i) for i in range(n)]))]


def _theirs(name: str, n: int, execute_all_batches: bool) -> list[int]:
    """The installed torchrec's schedule for its class `name`."""
    cls = getattr(torchrec_pipelines, name)
    if name == "TrainPipelineBase":  # torchrec's has no such option and runs every batch
        return schedule(cls, n)
    return schedule(cls, n, execute_all_batches=execute_all_batches)


def _oracle(name: str, n: int, execute_all_batches: bool) -> list[int]:
    """The schedule ours must follow: torchrec's, with the Prefetch pipeline's fixed rule (torchrec
    fixed 1.8.0's guard in `fill_pipeline` later; its newer test expects N-2 outputs, as SparseDist)."""
    if name == "PrefetchTrainPipelineSparseDist" and not execute_all_batches:
        return list(range(max(0, n - 2)))
    return _theirs(name, n, execute_all_batches)


@pytest.mark.parametrize("name", PIPELINES)
@pytest.mark.parametrize("execute_all_batches", [True, False])
def test_schedule_matches_torchrec_for_every_length(name, execute_all_batches):
    for n in range(13):
        theirs = _oracle(name, n, execute_all_batches)
        ours = schedule(getattr(pipeline, name), n, execute_all_batches=execute_all_batches)
        assert ours == theirs, f"{n} batches"
        assert ours == list(range(len(ours)))  # a prefix: the tail is dropped, nothing else


def test_torchrec_drop_counts_are_what_the_docs_say():
    """docs/reference.md states these, per torchrec release; a torchrec upgrade that changes them fails
    here."""
    counts = {name: [len(_theirs(name, n, False)) for n in range(10)] for name in PIPELINES}
    prefetch = [0, 0, 0, 1, 2, 3, 4, 5, 6, 7] if TORCHREC_PREFETCH_FIXED else [0, 0, 0, 1, 1, 1, 2, 3, 4, 5]
    assert counts == {
        "TrainPipelineBase": list(range(10)),
        "TrainPipelineSparseDist": [0, 0, 0, 1, 2, 3, 4, 5, 6, 7],
        "PrefetchTrainPipelineSparseDist": prefetch,
    }, f"torchrec {version('torchrec')}"


# -- on the sharded model, 2 ranks ---------------------------------------------------------------


def _state(model) -> list:
    from tests import models

    return [t.clone() for t in models.flat_tensors(model.state_dict())]


def _reference(kind: str, sharding: str, data: list) -> tuple[list, list]:
    """The plain loop's per-step outputs, and its parameters before and after every step."""
    from tests import models

    model, opt = models.build(kind, sharding)
    outputs, states = [], [_state(model)]
    for batch in data:
        outputs += models.plain_loop(model, opt, [batch])
        states.append(_state(model))
    return outputs, states


def _lengths(rank: int, world_size: int, name: str) -> dict:
    """Ours and (but for Prefetch, which needs CUDA) torchrec's `name` on every length."""
    from tests import models

    kind, sharding = "dlrm", "table_wise"
    out = {}
    for n in LENGTHS:
        expected, states = _reference(kind, sharding, models.batches(kind, n, rank, seed=20 + n))
        runs = {"ours": getattr(pipeline, name)}
        if name != "PrefetchTrainPipelineSparseDist":
            runs["torchrec"] = getattr(torchrec_pipelines, name)
        for who, cls in runs.items():
            model, opt = models.build(kind, sharding)
            no_option = (who, name) == ("torchrec", "TrainPipelineBase")
            options = {} if no_option else {"execute_all_batches": False}
            pipe = cls(model, opt, torch.device("cpu"), **options)
            got = models.run_to_end(pipe, iter(models.batches(kind, n, rank, seed=20 + n)))
            out[who, n] = {
                "count": len(got),
                "outputs": models.bitwise_equal(expected[: len(got)], got),
                "params": models.bitwise_equal(states[len(got)], _state(model)),
            }
        if name == "PrefetchTrainPipelineSparseDist":  # torchrec's fixed rule (see `_oracle`)
            out["torchrec", n] = {"count": len(_oracle(name, n, False))}
    return out


def _collections(rank: int, world_size: int, name: str, sharding: str) -> dict:
    from tests import models

    expected, states = _reference("postproc", sharding, models.batches("postproc", 12, rank))
    model, opt = models.build("postproc", sharding)
    pipe = getattr(pipeline, name)(model, opt, torch.device("cpu"), pipeline_postproc=True)
    got = models.run_to_end(pipe, iter(models.batches("postproc", 12, rank)))
    return {
        "outputs": len(got) == 12 and models.bitwise_equal(expected, got),
        "params": models.bitwise_equal(states[-1], _state(model)),
        "paths": {m.fqn: m.path for m in pipe.rewrite_report.modules},
        "not_pipelined": [m.fqn for m in pipe.rewrite_report.not_pipelined],
    }


@pytest.mark.parametrize("name", PIPELINES)
def test_execute_all_batches_false_drops_what_torchrec_drops(pool, name):
    for r in pool.run(_lengths, name, timeout=TIMEOUT):
        for n in LENGTHS:
            ours = r["ours", n]
            assert ours["count"] == r["torchrec", n]["count"], f"{n} batches"
            assert ours["outputs"] and ours["params"], f"{n} batches: not the plain loop's first steps"
            if name != "PrefetchTrainPipelineSparseDist":  # torchrec's ran here too: the same steps
                assert r["torchrec", n]["outputs"] and r["torchrec", n]["params"], f"{n} batches"


@pytest.mark.parametrize("name", PIPELINES[1:])
@pytest.mark.parametrize("sharding", ["table_wise", "row_wise"])
def test_postprocs_called_with_collections(pool, name, sharding):
    for rank, r in enumerate(pool.run(_collections, name, sharding, timeout=TIMEOUT)):
        assert r["not_pipelined"] == [], f"rank {rank}: {r['not_pipelined']} fell back to their own forward"
        assert r["paths"] == {
            "user_ebc": "shift([batch.features.user, batch.dense], {'by': 1})",
            "item_ebc": "pick({'kjts': (batch.features.item, batch.features.user), 'index': 0})",
        }
        assert r["outputs"], "per-step outputs differ from the plain loop"
        assert r["params"], "final parameters differ from the plain loop"
