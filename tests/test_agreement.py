"""The agreement's pieces in one process: the key check's fast path, the flags read ahead, the
background thread. (The 2-rank behaviour is in test_ranks.py.)"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torchrec import KeyedJaggedTensor

from pipeline.ranks import KeyCheck, Status, StoreFlags, in_background


@dataclass
class _Batch:
    sparse: object
    dense: torch.Tensor


def _batch(keys: list[str]) -> _Batch:
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.arange(len(keys)), lengths=torch.ones(len(keys), dtype=torch.int32)
    )
    return _Batch(sparse=kjt, dense=torch.zeros(1))


def test_key_check_passes_same_keys_and_names_renamed_or_missing_ones():
    check = KeyCheck()
    assert check.check(_batch(["f0", "f1"])) is None  # the reference
    assert check.check(_batch(["f0", "f1"])) is None
    assert check.check(_batch(["f0", "zz"])) == [("batch.sparse", ["f0", "zz"])]
    assert check.check(_batch(["f1", "f0"])) == [("batch.sparse", ["f1", "f0"])]
    assert check.check(_Batch(sparse=None, dense=torch.zeros(1))) == []


def _raise(store: dist.Store, prefix: str, rank: int, status: int, position: int) -> None:
    store.set(f"{prefix}/r{rank}", f"{status} {position}")
    store.add(f"{prefix}/events", 1)


def test_flags_read_in_the_background_see_what_was_raised_before_the_read_started():
    store = dist.HashStore()
    flags = StoreFlags(store, "p")
    assert flags.statuses(3, 2) == [Status.HAVE, Status.HAVE]
    _raise(store, "p", 1, Status.EXHAUSTED, 4)
    flags.read_in_background(through=7)
    assert flags.statuses(4, 2, seq=7) == [Status.HAVE, Status.EXHAUSTED]
    assert flags.statuses(9, 2, seq=5) == [Status.HAVE, Status.EXHAUSTED]  # the same read serves seq 5


def test_flags_read_now_for_a_batch_the_background_read_does_not_serve():
    store = dist.HashStore()
    flags = StoreFlags(store, "p")
    flags.read_in_background(through=1)
    in_background(lambda: None).result()  # the background read has run
    _raise(store, "p", 0, Status.EXHAUSTED, 2)
    assert flags.statuses(2, 2, seq=2) == [Status.EXHAUSTED, Status.HAVE]  # read now, not the stale count


def test_background_calls_run_in_order_and_hand_back_errors():
    order: list[int] = []
    first = in_background(lambda: (time.sleep(0.05), order.append(1)))
    second = in_background(lambda: order.append(2))
    second.result(timeout=5)
    assert first.done() and order == [1, 2]
    with pytest.raises(ZeroDivisionError):
        in_background(lambda: 1 / 0).result(timeout=5)


class _Reports:
    """Stands in for `Ranks`: records the collectives the hooks report."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def world_collective_issued(self) -> str:
        self.calls.append("issued")
        return "mark"

    def world_collective_completed(self, mark: str | None) -> None:
        self.calls.append(f"completed {mark}")


def _forward_collectives(rank: int, world_size: int) -> dict:
    from pipeline.ranks.seen import WorldCollectiveHooks
    from tests import models

    seen = {}
    for sharding in ("table_wise", "column_wise", "data_parallel"):
        model, _ = models.build("dlrm", sharding)
        reports = _Reports()
        hooks = WorldCollectiveHooks(model, reports)
        model(models.batches("dlrm", 1, rank)[0])
        seen[sharding] = list(reports.calls)
        if sharding == "table_wise":
            seen["hooked"] = sum(len(m._forward_hooks) for m in model.modules())
            hooks.remove()
            model(models.batches("dlrm", 1, rank)[0])
            seen["hooks_left"] = sum(len(m._forward_hooks) for m in model.modules())
            seen["after_remove"] = list(reports.calls)
    seen["pipeline_hooks_left"] = _hooks_left_by_a_dropped_pipeline(rank)
    return seen


def _hooks_left_by_a_dropped_pipeline(rank: int) -> tuple[int, int]:
    """Forward hooks on the model after a Base pipeline trained on it and was dropped."""
    import gc

    import pipeline
    from tests import models

    model, opt = models.build("dlrm", "table_wise")
    pipe = pipeline.TrainPipelineBase(model, opt, torch.device("cpu"))
    models.run_to_end(pipe, iter(models.batches("dlrm", 4, rank)))
    hooked = sum(len(m._forward_hooks) for m in model.modules())
    del pipe
    gc.collect()
    return hooked, sum(len(m._forward_hooks) for m in model.modules())


def test_forward_hooks_report_the_all_to_alls_over_every_rank_only():
    """Base's step reports the input all-to-all a sharded module runs inside forward, issued and
    then completed, when it spans every rank; never for data-parallel tables (whose input_dist
    sends nothing)."""
    from tests.harness import run_ranks

    for seen in run_ranks(_forward_collectives, 2, timeout=120):
        assert seen["table_wise"] == ["issued", "completed mark"], seen
        assert seen["column_wise"] == ["issued", "completed mark"], seen
        assert seen["data_parallel"] == [], seen
        assert seen["hooked"] == 1 and seen["hooks_left"] == 0, seen
        assert seen["after_remove"] == ["issued", "completed mark"], "a removed hook still reported"
        assert seen["pipeline_hooks_left"] == (1, 0)  # hooked while the pipeline lived, not after
