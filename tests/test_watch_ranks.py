"""The default schedule's watch at 3 and 4 gloo ranks: the ranks publish different shares, and every
rank takes the same decision at the same step from the mean of all of them, bit for bit as the
plain loop across the switch."""

from __future__ import annotations

import pytest

from tests.harness import pytest_timeout, run_ranks

KIND, SHARDING, STEPS = "nested", "table_wise", 40
TIMEOUT = 150
pytestmark = [pytest.mark.slow, pytest.mark.timeout(pytest_timeout(TIMEOUT))]


def _watched(rank: int, world_size: int, shares: tuple[float, ...]) -> dict:
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
    watch = Fixed(
        window=3, verify=3, warmup=0, settle=0, margin=0.0, sure=0.0, clock=lambda: float(next(counter))
    )
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
        "equal": len(got) == STEPS and models.bitwise_equal(expected, got),
        "params": models.bitwise_equal(ref.state_dict(), model.state_dict()),
    }


@pytest.mark.parametrize(
    ("shares", "moves"),
    [
        ((0.9, 0.9, 0.0), True),  # mean 0.6: every rank moves, the one that waits least too
        ((0.7, 0.7, 0.0, 0.0), False),  # mean 0.35: no rank moves, the two that wait most neither
        ((0.0, 0.0, 0.7, 0.7), False),
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
