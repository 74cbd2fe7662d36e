"""The multi-rank harness itself: success, a raising rank, a hanging rank."""

import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import RankError, RankTimeout, run_ranks


def _all_to_all(rank: int, world_size: int) -> list[int]:
    send = torch.arange(world_size) + 10 * rank
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    return recv.tolist()


def test_two_rank_all_to_all():
    results = run_ranks(_all_to_all, 2, timeout=60)
    # rank r receives element r from every peer p: 10 * p + r
    assert results == [[0, 10], [1, 11]]


def _rank1_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom from rank one")
    dist.barrier()  # rank 0 blocks on the dead peer until the harness kills it


def test_raising_rank_reports_its_traceback():
    with pytest.raises(RankError) as info:
        run_ranks(_rank1_raises, 2, timeout=60, grace=2)
    msg = str(info.value)
    assert "rank 1 raised" in msg
    assert "ValueError: boom from rank one" in msg
    assert "_rank1_raises" in msg  # the traceback, not just the message


def _rank0_hangs(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(3600)


def test_hanging_rank_fails_within_timeout():
    start = time.monotonic()
    with pytest.raises(RankTimeout, match=r"rank\(s\) \[0\]"):
        run_ranks(_rank0_hangs, 2, timeout=8)
    assert time.monotonic() - start < 30
