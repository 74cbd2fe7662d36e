"""The default schedule's watch at 3 and 4 gloo ranks: the ranks publish different shares, and every
rank takes the same decision at the same step from the mean of all of them, bit for bit as the
plain loop across the switch."""

from __future__ import annotations

import pytest

from tests.harness import pytest_timeout, run_ranks

KIND, SHARDING, STEPS = "nested", "table_wise", 40
TIMEOUT = 150
pytestmark = [pytest.mark.slow, pytest.mark.timeout(pytest_timeout(TIMEOUT))]


def _watched(rank: int, world_size: int, shares: tuple[float, ...], patience: int = 256, **settings) -> dict:
    import itertools

    import torch

    from pipeline import InputDistOptions, ScheduleWatch, TrainPipelineSparseDist
    from tests import models

    class Fixed(ScheduleWatch):
        """Publishes this rank's share from `shares` once a window is full (the clock counts its
        calls, so every step takes as long: a ratio of 1 after the switch)."""

        def _share(self) -> float | None:
            return shares[rank] if len(self._samples) >= self.window else None

    counter = itertools.count()
    quick = {"window": 3, "verify": 3, "warmup": 0, "settle": 0, "margin": 0.0, "sure": 0.0, **settings}
    watch = Fixed(**quick, patience=patience, clock=lambda: float(next(counter)))
    ref, ref_opt = models.build(KIND, SHARDING)
    model, opt = models.build(KIND, SHARDING)
    pipe = TrainPipelineSparseDist(model, opt, torch.device("cpu"), input_dist=InputDistOptions(watch=watch))
    data = models.batches(KIND, STEPS, rank, seed=21)
    expected = models.plain_loop(ref, ref_opt, data)
    ran: list[str] = []
    got = models.run_to_end(pipe, iter(data), schedules=ran)
    return {
        "ran": ran,
        "shares": watch.shares,
        "phase": watch.phase.value,
        "decisions": watch.decisions,
        "equal": len(got) == STEPS and models.bitwise_equal(expected, got),
        "params": models.bitwise_equal(ref.state_dict(), model.state_dict()),
    }


@pytest.mark.parametrize(
    ("shares", "moves"),
    [
        ((0.9, 0.9, 0.0), True),  # mean 0.6: every rank moves, the one that waits least too
        ((0.4, 0.4, 0.0, 0.0), False),  # mean 0.2: no rank moves, the two that wait most neither
        ((0.0, 0.0, 0.4, 0.4), False),
        ((0.6, 0.6, 0.6, 0.3), True),  # mean 0.525
    ],
)
def test_every_rank_decides_from_the_mean_of_all_ranks_at_the_same_step(shares, moves):
    ranks = run_ranks(_watched, len(shares), args=(shares,), timeout=TIMEOUT)
    assert all(r["ran"] == ranks[0]["ran"] for r in ranks), [r["ran"] for r in ranks]
    for r in ranks:
        assert r["equal"] and r["params"], "not bit for bit across the switch"
        assert ("early" in r["ran"]) is moves, r["ran"]
        if moves:
            assert r["shares"] == pytest.approx(list(shares), abs=0.001)


@pytest.mark.parametrize("shares", [(0.2, 0.2), (0.5, 0.0, 0.1), (0.4, 0.4, 0.0, 0.0)], ids=["2", "3", "4"])
def test_a_job_with_nothing_to_hide_stops_watching_on_every_rank_at_the_same_step(shares):
    """The ranks' mean stays under 25 % (one rank's share over it): after 5 figures every rank pins
    torchrec's order at the same step, bit for bit as the plain loop. Twin: patience 0 watches on."""
    ranks = run_ranks(_watched, len(shares), args=(shares, 5), timeout=TIMEOUT)
    assert all(r["decisions"] == ranks[0]["decisions"] for r in ranks), [r["decisions"] for r in ranks]
    for r in ranks:
        assert r["equal"] and r["params"], "not bit for bit"
        assert r["phase"] == "pinned" and r["ran"] == ["late"] * STEPS, r
        assert "nothing to hide" in r["decisions"][-1][1], r["decisions"]
    twin = run_ranks(_watched, len(shares), args=(shares, 0), timeout=TIMEOUT)
    assert all(r["phase"] == "watching" for r in twin), [r["phase"] for r in twin]


def _again(rank: int, world_size: int, shares: tuple[float, ...]) -> dict:
    return _watched(rank, world_size, shares, margin=0.5, retries=1, backoff=1)


@pytest.mark.parametrize("world", [3, 4])
def test_an_unsure_verdict_is_tried_again_on_every_rank_at_the_same_steps(world):
    """Every step as long after the switch as before (a ratio of 1): under a margin of 0.5 that is
    unsure, so every rank goes back, tries early once more at the same step, and goes back for
    good, bit for bit as the plain loop across the four switches."""
    ranks = run_ranks(_again, world, args=((0.9,) * world,), timeout=TIMEOUT)
    assert all(r["ran"] == ranks[0]["ran"] for r in ranks), [r["ran"] for r in ranks]
    for r in ranks:
        assert r["equal"] and r["params"], "not bit for bit across the switches"
        ran = r["ran"]
        assert [s for i, s in enumerate(ran) if i == 0 or ran[i - 1] != s] == [
            "late",
            "early",
            "late",
            "early",
            "late",
        ]
        assert r["phase"] == "back" and len(r["decisions"]) == 4, r["decisions"]
