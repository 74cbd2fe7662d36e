"""The agreement's pieces: the key check's fast path, the vote's size, and no store request per batch
(at 2, 3 and 4 ranks). (Uneven data, bad keys and failures across ranks are in test_ranks.py.)"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torchrec import KeyedJaggedTensor

from pipeline.ranks import KeyCheck, Status


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


def test_a_vote_counts_statuses_and_does_not_grow_with_the_world():
    from pipeline.ranks import Votes

    vote = Votes(timeout=timedelta(seconds=5)).vote(Status.BAD_KEYS)  # no process group: local
    assert vote.tensor.numel() == 1, "one int64 of packed counts, whatever the world size"
    assert vote.wait() == {Status.EXHAUSTED: 0, Status.HAVE: 0, Status.BAD_KEYS: 1, Status.MALFORMED: 0}
    # summed over 1,000 ranks (what the all_reduce does), the fields do not carry into each other
    from pipeline.ranks.protocol import Vote

    votes = Votes(timeout=timedelta(seconds=5))
    each = [votes.vote(s).tensor for s in [Status.HAVE] * 997 + [Status.EXHAUSTED] * 2 + [Status.MALFORMED]]
    summed = Vote(None, sum(each))
    assert summed.wait() == {Status.EXHAUSTED: 2, Status.HAVE: 997, Status.BAD_KEYS: 0, Status.MALFORMED: 1}


class _CountingStore(dist.Store):
    """The default group's store, counting the requests made through it."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner, self.requests = inner, 0

    def __getattribute__(self, name: str):
        if name in ("set", "get", "add", "check", "wait", "compare_set", "delete_key", "num_keys"):
            object.__getattribute__(self, "_count")()
            return getattr(object.__getattribute__(self, "inner"), name)
        return object.__getattribute__(self, name)

    def _count(self) -> None:
        self.requests += 1


def _store_requests_per_batch(rank: int, world_size: int) -> dict:
    import pipeline
    from tests import models

    store = _CountingStore(dist.distributed_c10d._get_default_store())
    real = dist.distributed_c10d._get_default_store
    dist.distributed_c10d._get_default_store = lambda: store  # what the pipeline takes at construction
    try:
        model, opt = models.build("dlrm", "table_wise")
        pipe = pipeline.TrainPipelineSparseDist(model, opt, torch.device("cpu"))
        it = iter(models.batches("dlrm", 16, rank))
        for _ in range(4):  # the first batches create the pipeline's groups (a rendezvous)
            pipe.progress(it)
        before = store.requests
        for _ in range(8):
            pipe.progress(it)
        return {
            "after_warmup": store.requests - before,
            "votes": pipe._ranks.votes,
            "carried": pipe._ranks.carried,
        }
    finally:
        dist.distributed_c10d._get_default_store = real


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_agreement_sends_no_request_to_the_store_per_batch(world):
    """Per batch the ranks agree by a collective, never by a request to rank 0's store: at 1,024
    ranks that would be a fan-in of requests to one process. The first batches are voted on (one
    small all_reduce each); once the splits all-to-all of the sharded modules is fused, a batch's
    status rides on it and no vote is needed."""
    from tests.harness import run_ranks

    for rank, seen in enumerate(run_ranks(_store_requests_per_batch, world, timeout=120)):
        assert seen["after_warmup"] == 0, f"rank {rank}: {seen['after_warmup']} store requests in 8 steps"
        assert seen["votes"] + seen["carried"] >= 12, f"rank {rank}: a status per batch fetched, got {seen}"
        assert seen["carried"] >= 8 and seen["votes"] <= 4, f"rank {rank}: statuses did not ride: {seen}"
