"""The multi-rank harness itself: results, a raising rank, a hanging rank, a killed rank, and one
scenario failing exactly its own test while the module's other scenarios run and pass."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.harness import START_TIMEOUT, RankError, RankPool, RankTimeout, pytest_timeout, run_ranks

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.timeout(pytest_timeout(60) + 120), pytest.mark.slow]


def _all_to_all(rank: int, world_size: int, base: int = 10) -> list[int]:
    send = torch.arange(world_size) + base * rank
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


def test_raising_rank_reports_its_traceback_and_the_scenario():
    with pytest.raises(RankError) as info:
        run_ranks(_rank1_raises, 2, timeout=60, grace=2)
    msg = str(info.value)
    assert msg.startswith("scenario _rank1_raises failed:"), msg
    assert "rank 1 raised" in msg and "ValueError: boom from rank one" in msg
    assert "_rank1_raises" in msg.split("rank 1 raised", 1)[1]  # the traceback, not just the message


def _rank0_hangs(rank: int, world_size: int, seconds: float) -> None:
    if rank == 0:
        time.sleep(seconds)


HANG = 3
"""The scenario timeout of the tests that hang a rank on purpose: they wait it out. Rank 1 of
`_rank0_hangs` and the `ok` scenarios of `_MODULE` (one all-reduce) end in milliseconds."""


def test_hanging_rank_fails_within_timeout_naming_the_scenario():
    start = time.monotonic()
    with pytest.raises(RankTimeout, match=r"scenario _rank0_hangs\(3600\) hung: rank\(s\) \[0\] of 2"):
        run_ranks(_rank0_hangs, 2, timeout=HANG, args=(3600,))
    assert time.monotonic() - start < START_TIMEOUT + HANG + 10


def _rank1_killed(rank: int, world_size: int) -> str:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return "rank 0 finished"


def test_a_rank_killed_by_a_signal_is_reported_as_such():
    with pytest.raises(RankError, match=r"rank 1 was killed by signal SIGKILL \(exit status -9\)") as info:
        run_ranks(_rank1_killed, 2, timeout=60)
    assert info.value.results == {0: "rank 0 finished"}


def _destroys_group(rank: int, world_size: int) -> int:
    dist.destroy_process_group()
    return rank


def test_pool_reuses_ranks_and_restarts_after_failures():
    pool = RankPool(2, grace=2)
    try:
        assert pool.run(_all_to_all) == [[0, 10], [1, 11]]
        assert pool.run(_all_to_all, 100) == [[0, 100], [1, 101]]
        assert pool.starts == 1, "a passing scenario must not restart the ranks"
        with pytest.raises(RankError, match="scenario _rank1_raises failed"):
            pool.run(_rank1_raises)
        assert pool.run(_all_to_all) == [[0, 10], [1, 11]]  # fresh ranks
        assert pool.starts == 2
        assert pool.run(_destroys_group) == [0, 1]  # a rank without a group ends: the next restarts
        assert pool.run(_all_to_all) == [[0, 10], [1, 11]]
        assert pool.starts == 3
    finally:
        pool.close()


def test_pytest_timeout_sits_above_the_harness_join():
    assert pytest_timeout(120) > START_TIMEOUT + 120 + 5


_MODULE = """
import time

import pytest
import torch.distributed as dist

from tests.harness import pytest_timeout

def ok(rank, world_size):
    t = dist.all_reduce(__import__("torch").ones(1)) or None
    return rank

def raises(rank, world_size):
    if rank == 0:
        raise KeyError("broken on purpose")
    dist.barrier()

def hangs(rank, world_size):
    dist.barrier()
    if rank == 1:
        time.sleep(3600)
    dist.barrier()

@pytest.mark.timeout(pytest_timeout(HANG))
@pytest.mark.parametrize("name", ["ok", "raises", "hangs", "ok_after"])
def test_scenario(pool, name):
    fn = {"ok": ok, "raises": raises, "hangs": hangs, "ok_after": ok}[name]
    assert pool.run(fn, timeout=HANG) == [0, 1]
"""


def test_one_broken_scenario_fails_exactly_its_own_test(tmp_path):
    """A module of four scenarios on one pool: the raising one and the hanging one fail with their
    own message; the ones before and after them pass (the last on fresh ranks)."""
    module = tmp_path / "test_generated.py"
    module.write_text(textwrap.dedent(_MODULE).replace("HANG", str(HANG)))
    (tmp_path / "conftest.py").write_text("from tests.conftest import pool  # noqa: F401\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "400"}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            str(module),
            "-q",
            "-p",
            "no:cacheprovider",
            "-rA",
            "--rootdir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=pytest_timeout(60) + 60,
    )
    out = run.stdout
    assert "2 failed, 2 passed" in out, out
    assert "PASSED test_generated.py::test_scenario[ok]" in out, out
    assert "PASSED test_generated.py::test_scenario[ok_after]" in out, out
    assert "FAILED test_generated.py::test_scenario[raises] - tests.harness.RankError: scenario raises" in out
    assert "KeyError: 'broken on purpose'" in out
    assert (
        "FAILED test_generated.py::test_scenario[hangs] - tests.harness.RankTimeout: scenario hangs hung"
        in out
    )
