"""Ranks that disagree: uneven data, a batch with wrong keys, a rank that raises, and checkpoints
taken with batches in flight. Every pipeline, 2 gloo ranks, real all-to-alls.

Each case is a question the user asks when one rank is not like the others: do both ranks stop at
the same step with the plain loop's parameters, does the error reach every rank, does a dead peer
stop the others quickly, does a resumed run train every batch exactly once.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest

from tests.harness import run_ranks

PIPELINES = ("TrainPipelineBase", "TrainPipelineSparseDist", "PrefetchTrainPipelineSparseDist")
LONG = 12
# (batches on rank 0, batches on rank 1): rank 1 short by 1, 2, 3 and 10; rank 0 short by 2; rank 1
# with one batch and with none (the ranks learn of these from the votes of a lane's first two
# batches, of the others from the flags in the store)
UNEVEN = [
    (LONG, LONG - 1),
    (LONG, LONG - 2),
    (LONG, LONG - 3),
    (LONG, LONG - 10),
    (LONG - 2, LONG),
    (LONG, 1),
    (LONG, 0),
]


class Stateful:
    """An iterator over a list whose position can be saved and restored (a StatefulDataLoader's
    contract: `state_dict()` says where the next batch comes from)."""

    def __init__(self, data: list, position: int = 0) -> None:
        self.data, self.position = data, position

    def __iter__(self):
        return self

    def __next__(self):
        if self.position >= len(self.data):
            raise StopIteration
        self.position += 1
        return self.data[self.position - 1]

    def state_dict(self) -> dict:
        return {"position": self.position}


# -- uneven data ------------------------------------------------------------------------------


def _uneven(rank: int, world_size: int) -> dict:
    import warnings

    import torch

    import pipeline
    from tests import models

    results = {}
    for (pipe_name, sharding), counts in itertools.product(
        itertools.product(PIPELINES, ("table_wise", "column_wise")), UNEVEN
    ):
        if sharding == "column_wise" and counts != UNEVEN[1]:
            continue  # column-wise: one uneven case per pipeline is enough
        common = min(counts)
        ref_model, ref_opt = models.build("dlrm", sharding)
        expected = models.plain_loop(ref_model, ref_opt, models.batches("dlrm", common, rank))
        model, opt = models.build("dlrm", sharding)
        pipe = getattr(pipeline, pipe_name)(model, opt, torch.device("cpu"))
        start = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outputs = models.run_to_end(pipe, iter(models.batches("dlrm", counts[rank], rank)))
        results[(pipe_name, sharding, counts)] = {
            "seconds": time.monotonic() - start,
            "count": len(outputs),
            "outputs_equal": models.bitwise_equal(expected, outputs),
            "params_equal": models.bitwise_equal(ref_model.state_dict(), model.state_dict()),
            "untrained": len(pipe.untrained_batches),
            "warnings": [str(w.message) for w in caught if "not trained" in str(w.message)],
        }
        # the error mode, same data: every rank raises, naming both counts
        model, opt = models.build("dlrm", sharding)
        pipe = getattr(pipeline, pipe_name)(model, opt, torch.device("cpu"), on_uneven="error")
        try:
            models.run_to_end(pipe, iter(models.batches("dlrm", counts[rank], rank)))
            results[(pipe_name, sharding, counts)]["error"] = None
        except pipeline.UnevenDataError as e:
            results[(pipe_name, sharding, counts)]["error"] = str(e)
    return results


@pytest.fixture(scope="module")
def uneven() -> list[dict]:
    return run_ranks(_uneven, 2, timeout=300)


UNEVEN_CASES = [(p, "table_wise", c) for p in PIPELINES for c in UNEVEN] + [
    (p, "column_wise", UNEVEN[1]) for p in PIPELINES
]


@pytest.mark.parametrize(("pipe_name", "sharding", "counts"), UNEVEN_CASES)
def test_uneven_data_trains_the_common_count_on_every_rank(uneven, pipe_name, sharding, counts):
    common = min(counts)
    for rank, per_rank in enumerate(uneven):
        r = per_rank[(pipe_name, sharding, counts)]
        assert r["count"] == common, f"rank {rank}: {r['count']} outputs, expected {common}"
        assert r["outputs_equal"], f"rank {rank}: outputs differ from the plain loop on {common} batches"
        assert r["params_equal"], f"rank {rank}: parameters differ from the plain loop on {common} batches"
        assert r["seconds"] < 60, f"rank {rank}: took {r['seconds']:.0f} s"
        longer = counts[rank] > common
        # the longer rank fetched ahead: what it did not train is reported, with a warning
        assert (r["untrained"] > 0) == longer, r
        assert (len(r["warnings"]) == 1) == longer, r["warnings"]
        assert r["error"] is not None and f"have {common} batches" in r["error"], r["error"]


# -- wrong keys --------------------------------------------------------------------------------


def _wrong_keys(rank: int, world_size: int) -> dict:
    import torch
    import torch.distributed as dist
    from torchrec import KeyedJaggedTensor

    import pipeline
    from tests import models

    results = {}
    for pipe_name in PIPELINES:
        data = models.batches("dlrm", 10, rank)
        if rank == 1:
            kjt = data[5].sparse_features
            data[5].sparse_features = KeyedJaggedTensor.from_lengths_sync(
                keys=["f0", "f1", "zz"], values=kjt.values(), lengths=kjt.lengths()
            )
        model, opt = models.build("dlrm", "table_wise")
        pipe = getattr(pipeline, pipe_name)(model, opt, torch.device("cpu"))
        it = iter(data)
        trained = 0
        try:
            while True:
                pipe.progress(it)
                trained += 1
        except pipeline.BatchKeysError as e:
            error = str(e)
        except StopIteration:
            error = None
        # the process group is still usable: nobody was left inside a collective
        t = torch.ones(1)
        dist.all_reduce(t)
        results[pipe_name] = {"error": error, "trained": trained, "group_ok": t.item() == 2}
    return results


def test_wrong_keys_on_one_rank_stop_every_rank_with_the_keys():
    per_rank = run_ranks(_wrong_keys, 2, timeout=180)
    for pipe_name in PIPELINES:
        for rank, results in enumerate(per_rank):
            r = results[pipe_name]
            assert r["error"] is not None, f"{pipe_name} rank {rank}: trained all batches, no error"
            assert "batch 5 of rank 1" in r["error"], r["error"]
            assert "['f0', 'f1', 'zz']" in r["error"] and "['f0', 'f1', 'f2']" in r["error"], r["error"]
            assert r["trained"] <= 5 and r["group_ok"], r
        assert per_rank[0][pipe_name]["trained"] == per_rank[1][pipe_name]["trained"]


# -- a failing rank ----------------------------------------------------------------------------


def _failing(rank: int, world_size: int, pipe_name: str) -> dict:
    import torch

    import pipeline
    from tests import models

    model, opt = models.build("dlrm", "table_wise")
    calls = 0
    raised_at = None

    def forward(batch):
        nonlocal calls, raised_at
        calls += 1
        if rank == 1 and calls == 6:  # step 5 (0-based)
            raised_at = time.time()
            raise ValueError("bad batch on purpose")
        return model(batch)

    pipe = getattr(pipeline, pipe_name)(model, opt, torch.device("cpu"), custom_model_fwd=forward)
    it = iter(models.batches("dlrm", 20, rank))
    try:
        while True:
            pipe.progress(it)
    except StopIteration:
        return {"error": None}
    except Exception as e:  # whichever error ends the rank is the result
        return {"error": f"{type(e).__name__}: {e}", "at": time.time(), "raised_at": raised_at}


@pytest.mark.parametrize("pipe_name", PIPELINES)
def test_a_rank_raising_stops_its_peer_quickly(pipe_name):
    r0, r1 = run_ranks(_failing, 2, timeout=120, args=(pipe_name,))
    assert r1["error"] == "ValueError: bad batch on purpose", r1
    assert r0["error"] is not None and r0["error"].startswith("PeerFailedError"), r0
    assert "rank 1 raised ValueError: bad batch on purpose" in r0["error"], r0
    waited = r0["at"] - r1["raised_at"]
    assert waited < 10, f"rank 0 ended {waited:.1f} s after rank 1 raised"


# -- checkpoints with batches in flight --------------------------------------------------------

CKPT_STEPS, CKPT_AT = 12, 5


def _checkpoint_save(rank: int, world_size: int, out: str) -> dict:
    import torch

    import pipeline
    from tests import models

    results = {}
    for pipe_name in PIPELINES:
        ref_model, ref_opt = models.build("dlrm", "table_wise")
        models.plain_loop(ref_model, ref_opt, models.batches("dlrm", CKPT_AT, rank))
        model, opt = models.build("dlrm", "table_wise")
        pipe = getattr(pipeline, pipe_name)(model, opt, torch.device("cpu"))
        loader = Stateful(models.batches("dlrm", CKPT_STEPS, rank))
        outputs = [pipe.progress(loader) for _ in range(CKPT_AT)]
        fetched_ahead = loader.position - CKPT_AT
        # with batches in flight, the model is the plain loop's at the same step
        in_flight_equal = models.bitwise_equal(ref_model.state_dict(), model.state_dict())
        outputs += pipe.drain(loader)
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "loader": loader.state_dict(),
                "outputs": outputs,
            },
            Path(out) / f"{pipe_name}-rank{rank}.pt",
        )
        results[pipe_name] = {"in_flight_equal": in_flight_equal, "fetched_ahead": fetched_ahead}
    return results


def _checkpoint_resume(rank: int, world_size: int, out: str) -> dict:
    import torch

    import pipeline
    from tests import models

    results = {}
    ref_model, ref_opt = models.build("dlrm", "table_wise")
    expected = models.plain_loop(ref_model, ref_opt, models.batches("dlrm", CKPT_STEPS, rank))
    for pipe_name in PIPELINES:
        saved = torch.load(Path(out) / f"{pipe_name}-rank{rank}.pt", weights_only=False)
        model, opt = models.build("dlrm", "table_wise", seed=7)  # other weights: the load must matter
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        loader = Stateful(models.batches("dlrm", CKPT_STEPS, rank), **saved["loader"])
        pipe = getattr(pipeline, pipe_name)(model, opt, torch.device("cpu"))
        rest = models.run_to_end(pipe, loader)
        outputs = saved["outputs"] + rest
        results[pipe_name] = {
            "count": len(outputs),
            "outputs_equal": models.bitwise_equal(expected, outputs),
            "params_equal": models.bitwise_equal(ref_model.state_dict(), model.state_dict()),
        }
    return results


def test_drain_then_checkpoint_resumes_bit_for_bit(tmp_path):
    saved = run_ranks(_checkpoint_save, 2, timeout=180, args=(str(tmp_path),))
    resumed = run_ranks(_checkpoint_resume, 2, timeout=180, args=(str(tmp_path),))
    for pipe_name in PIPELINES:
        for rank in range(2):
            s, r = saved[rank][pipe_name], resumed[rank][pipe_name]
            assert s["in_flight_equal"], f"{pipe_name} rank {rank}: state_dict at step {CKPT_AT} differs"
            if pipe_name != "TrainPipelineBase":
                assert s["fetched_ahead"] > 0, "the case must have batches in flight at the checkpoint"
            assert r["count"] == CKPT_STEPS, r
            assert r["outputs_equal"] and r["params_equal"], f"{pipe_name} rank {rank}: {r}"
