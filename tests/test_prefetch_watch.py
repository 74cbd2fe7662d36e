"""Prefetch's ahead-or-inline choice on CPU (pipeline.stages.prefetch) with fake clocks and
simulated ranks, and the words two watches share (pipeline.ranks.riding): it starts inline, observes
nothing while the caches fill, tries ahead where the stage blocks a steady share of the step, keeps it
only where the steps after are faster on every rank, else goes back once; it holds still while the
schedule's own choice verifies; alone (one rank, nothing rides) it decides from its own figure."""

from __future__ import annotations

import pytest
import torch

from pipeline.ranks.riding import Admission, figure_of, observed, tagged
from pipeline.stages.prefetch import PrefetchWatch
from pipeline.stages.watch import WatchPhase


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def simulate(steps: int, cost, *, ranks: int = 2, ready=None, partner=None, alone=False, **settings):
    """`ranks` watches in lockstep; `cost(rank, mode, step)` is (step_s, blocked_s): the step's time
    and, of it, the time the training thread blocked in the prefetch stage. Every rank's figure
    reaches every rank in the same step, as the words in the splits all-to-all do."""
    clocks = [FakeClock() for _ in range(ranks)]
    watches = [PrefetchWatch(clock=c, **settings) for c in clocks]
    for w in watches:
        w.ready, w.partner = ready, partner
        if alone:
            w.no_ride("one rank")
    ran: list[list[str]] = [[] for _ in range(ranks)]
    for step in range(1, steps + 1):
        figures = []
        for r, (watch, clock) in enumerate(zip(watches, clocks, strict=True)):
            mode = watch.step()
            ran[r].append(mode)
            figures.append(watch.observation())
            step_s, blocked_s = cost(r, mode, step)
            watch.blocked += blocked_s
            clock.now += step_s
            watch.step_ended()
        if not alone:
            for watch in watches:
                watch.received(list(figures))
    return watches, ran


def _disk_bound(r, mode, step):
    """Inline, a 100 ms step blocks 40 ms in the prefetch stage; ahead takes 65 ms."""
    return (0.100, 0.040) if mode == "inline" else (0.065, 0.002)


def test_a_step_that_blocks_in_the_prefetch_stage_runs_it_ahead_where_that_pays():
    watches, ran = simulate(60, _disk_bound)
    for watch, modes in zip(watches, ran, strict=True):
        assert watch.phase is WatchPhase.KEPT and watch.mode == "ahead", watch
        # 8 warm-up steps, a window of 8, and the first figure decides: every rank's share (40 %) is
        # twice the threshold
        assert modes[:17] == ["inline"] * 17 and modes.count("inline") == 17 and modes[-1] == "ahead"
        assert watch.shares == pytest.approx([0.4, 0.4]) and watch.ratios == pytest.approx([0.65, 0.65])
        assert watch.decisions[1][0] == 17 + 2 + 10 + 1  # a clear gain: verified over 10 steps
        assert "at least 40% on every rank: clear at the first figure" in watch.decisions[0][1]
    text = repr(watches[0])
    assert "trying it ahead" in text and "prefetch runs ahead on its worker thread" in text
    assert watches[0].reason.startswith("prefetch runs ahead")


def test_where_ahead_does_not_pay_it_goes_back_inline_once():
    watches, ran = simulate(200, lambda r, m, s: (0.100, 0.040) if m == "inline" else (0.104, 0.0), retries=0)
    for watch, modes in zip(watches, ran, strict=True):
        assert watch.phase is WatchPhase.BACK and watch.mode == "inline"
        # settle, 10 verified steps (none shorter than before: clear), the step that reads the verdict
        assert modes.count("ahead") == 2 + 10 + 1 and modes[-100:] == ["inline"] * 100
    assert "inline again" in watches[0].reason and "no second try" in watches[0].reason


def test_an_unsure_verdict_tries_ahead_again_and_a_clear_loss_is_final():
    """The schedule watch's second try holds here too: ahead 1 % slower is unsure, tried 3 times in
    all (32 steps after the first verdict, then 64), each going back inline on every rank at once;
    ahead 10 % slower is a clear loss, tried once."""
    watches, ran = simulate(400, lambda r, m, s: (0.100, 0.040) if m == "inline" else (0.101, 0.0))
    assert ran[0] == ran[1] and ran[0][-100:] == ["inline"] * 100
    assert all(w.phase is WatchPhase.BACK and w.tries == 3 for w in watches), [w.reason for w in watches]
    assert (
        "once more from step" in watches[0].decisions[1][1]
        and "no further try (3 tries)" in watches[0].reason
    )
    watches, ran = simulate(400, lambda r, m, s: (0.100, 0.040) if m == "inline" else (0.110, 0.0))
    assert all(w.tries == 1 and w.phase is WatchPhase.BACK for w in watches)
    assert ran[0].count("ahead") == 2 + 10 + 1 and "no second try" in watches[0].reason


def test_a_share_clear_on_one_rank_only_waits_for_a_steady_run_of_figures():
    """The first figure decides only where every rank's share is twice the threshold: at 40 % and
    30 % (mean 35 %, over the threshold), the ranks wait for 9 figures in a row, as at any share."""
    _, ran = simulate(
        60, lambda r, m, s: (0.100, 0.040 if r == 0 else 0.030) if m == "inline" else (0.065, 0.0)
    )
    assert all(modes.count("inline") == 25 for modes in ran), [m.count("inline") for m in ran]


def test_a_mixed_verification_takes_every_step_a_clear_one_half():
    """Ahead steps alternating 60 and 98 ms against 100 ms before: not every step clearly faster,
    so the verdict waits for all 20 steps (and keeps ahead); its twin, where every step is 60 ms,
    is decided after 10. Without the quick verdict (QUICK at 20), the clear case takes 20 too."""
    from unittest import mock

    def mixed(r, mode, step):
        return (0.100, 0.040) if mode == "inline" else ((0.060 if step % 2 else 0.098), 0.0)

    def clear(r, mode, step):
        return (0.100, 0.040) if mode == "inline" else (0.060, 0.0)

    verdict = {
        name: simulate(80, cost)[0][0].decisions[1][0] for name, cost in (("mixed", mixed), ("clear", clear))
    }
    assert verdict == {"mixed": 17 + 2 + 20 + 1, "clear": 17 + 2 + 10 + 1}
    with mock.patch("pipeline.stages.watch.QUICK", 20):
        assert simulate(80, clear)[0][0].decisions[1][0] == 17 + 2 + 20 + 1


def test_a_gain_on_one_rank_only_is_not_kept():
    """A rank 5 % or more slower ahead vetoes the job's gain (rank 1's steps ahead are 8 % slower:
    two ranks sharing the cores); its twin, rank 1 level, keeps ahead on the job's mean."""

    def cost(slower):
        def f(r, mode, step):
            if mode == "inline":
                return 0.100, 0.040
            return (0.065, 0.0) if r == 0 else (slower, 0.0)

        return f

    watches, ran = simulate(100, cost(0.108))
    assert ran[0] == ran[1] and all(w.phase is WatchPhase.BACK for w in watches)
    watches, ran = simulate(100, cost(0.100))
    assert ran[0] == ran[1] and all(w.phase is WatchPhase.KEPT for w in watches)


def test_nothing_changes_where_the_stage_blocks_little():
    watches, ran = simulate(200, lambda r, m, s: (0.100, 0.015))  # 15 %: under the 20 % threshold
    assert all(modes == ["inline"] * 200 for modes in ran)
    assert all(w.phase is WatchPhase.WATCHING and w.share == pytest.approx(0.15) for w in watches)


def test_nothing_is_observed_while_the_caches_fill():
    """A cold cache reads more: inline steps block 60 % until step 50, 10 % after (ahead would have
    looked worth trying on the cold steps). Twin: without the kernels' word it tries."""
    full = [False]

    def cost(r, mode, step):
        full[0] = step > 50
        return (0.100, 0.060 if step <= 50 else 0.010) if mode == "inline" else (0.090, 0.0)

    watches, ran = simulate(150, cost, ready=lambda: full[0])
    assert all(modes == ["inline"] * 150 for modes in ran)
    assert watches[0].ready_at == 52 and watches[0].share == pytest.approx(0.1)
    _, ran = simulate(150, cost)
    assert "ahead" in ran[0]


def test_it_holds_still_while_the_schedule_verifies_a_switch():
    class Tuning:
        tuning = True

    _, ran = simulate(100, _disk_bound, partner=Tuning())
    assert ran[0] == ["inline"] * 100
    Tuning.tuning = False
    _, ran = simulate(100, _disk_bound, partner=Tuning())
    assert "ahead" in ran[0]


def test_alone_it_decides_from_its_own_figure():
    watches, ran = simulate(60, _disk_bound, ranks=1, alone=True)
    assert watches[0].phase is WatchPhase.KEPT and ran[0][-1] == "ahead"
    assert not watches[0].publishing and "one rank" in repr(watches[0])


def test_state_dict_keeps_the_decision():
    watches, _ = simulate(60, _disk_bound)
    restored = PrefetchWatch(clock=lambda: (_ for _ in ()).throw(AssertionError("clock read")))
    restored.load_state_dict(watches[0].state_dict())
    assert restored.step() == "ahead" and restored.phase is WatchPhase.KEPT and not restored.clocked
    with pytest.raises(ValueError, match="names 'early'"):
        restored.load_state_dict({"phase": "kept", "mode": "early", "decisions": []})


# -- two watches in one word --------------------------------------------------------------------


class _Watch:
    def __init__(self, figure: float) -> None:
        self.figure, self.publishing, self.got, self.partner = figure, True, [], None

    def no_ride(self, reason: str) -> None:
        pass

    def observation(self) -> int:
        return observed(self.figure)

    def received(self, figures: list[int]) -> None:
        self.got.append(figures)


def test_two_watches_take_turns_in_the_words_and_each_reads_only_its_own():
    admission = Admission(None, False)
    first, second = _Watch(0.25), _Watch(0.5)
    admission.add_watch(first)
    admission.add_watch(second)
    assert first.partner is second and second.partner is first
    sent = [admission._figure() for _ in range(4)]
    assert [figure_of(f) for f in sent] == [(0, 251), (1, 501)] * 2
    admission._hand_out(torch.tensor([sent[0], sent[0]]))
    admission._hand_out(torch.tensor([sent[1], sent[1]]))
    admission._hand_out(torch.tensor([sent[0], sent[1]]))  # the ranks' words name different
    # watches: each watch sees another rank's figure missing (0), which decides nothing
    got = ([g.tolist() for g in first.got], [g.tolist() for g in second.got])
    assert got == ([[251, 251], [251, 0]], [[501, 501], [0, 501]])
    second.publishing = False  # decided: the other publishes in every word
    assert {figure_of(admission._figure())[0] for _ in range(3)} == {0}
    assert tagged(1, 0) == 0  # no figure: nothing to route
    with pytest.raises(ValueError, match="two watches at most"):
        admission.add_watch(_Watch(0.1))
