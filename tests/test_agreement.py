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


def test_flags_read_ahead_see_what_was_raised_before_the_read_started():
    store = dist.HashStore()
    flags = StoreFlags(store, "p")
    assert flags.statuses(3, 2) == [Status.HAVE, Status.HAVE]
    _raise(store, "p", 1, Status.EXHAUSTED, 4)
    flags.read_ahead(token=7)
    assert flags.statuses(4, 2, token=7) == [Status.HAVE, Status.EXHAUSTED]
    assert flags.statuses(9, 2, token=7) == [Status.HAVE, Status.EXHAUSTED]  # no read ahead left: read now


def test_flags_ignore_a_read_ahead_for_another_batch():
    store = dist.HashStore()
    flags = StoreFlags(store, "p")
    flags.read_ahead(token=1)
    in_background(lambda: None).result()  # the read ahead has run
    _raise(store, "p", 0, Status.EXHAUSTED, 2)
    assert flags.statuses(2, 2, token=2) == [Status.EXHAUSTED, Status.HAVE]  # read now, not the stale count


def test_background_calls_run_in_order_and_hand_back_errors():
    order: list[int] = []
    first = in_background(lambda: (time.sleep(0.05), order.append(1)))
    second = in_background(lambda: order.append(2))
    second.result(timeout=5)
    assert first.done() and order == [1, 2]
    with pytest.raises(ZeroDivisionError):
        in_background(lambda: 1 / 0).result(timeout=5)


def _forward_collectives(rank: int, world_size: int) -> dict:
    from pipeline.ranks import WorldCollectiveSeen
    from tests import models

    seen = {}
    for sharding in ("table_wise", "column_wise", "data_parallel"):
        model, _ = models.build("dlrm", sharding)
        watch = WorldCollectiveSeen(model)
        before = watch.take()
        model(models.batches("dlrm", 1, rank)[0])
        seen[sharding] = (before, watch.take(), watch.take())
        if sharding == "table_wise":
            seen["hooked"] = sum(len(m._forward_hooks) for m in model.modules())
            watch.remove()
            model(models.batches("dlrm", 1, rank)[0])
            seen["hooks_left"] = sum(len(m._forward_hooks) for m in model.modules())
            seen["after_remove"] = watch.take()
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


def test_world_collective_seen_after_a_sharded_forward_only():
    """Base reads the next batch's flags after forward only when forward waited for an all-to-all
    over every rank: not before any forward, once per forward, never for data-parallel tables (whose
    input_dist sends nothing)."""
    from tests.harness import run_ranks

    for seen in run_ranks(_forward_collectives, 2, timeout=120):
        assert seen["table_wise"] == (False, True, False)
        assert seen["column_wise"] == (False, True, False)
        assert seen["data_parallel"] == (False, False, False)
        assert seen["hooked"] == 1 and seen["hooks_left"] == 0 and seen["after_remove"] is False
        assert seen["pipeline_hooks_left"] == (1, 0)  # hooked while the pipeline lived, not after
