"""The default schedule's watch (pipeline.stages.watch) and the word its figures ride in
(pipeline.ranks.riding), with fake clocks and simulated ranks: when it tries "early", when it keeps
it, when it goes back, and that every rank decides alike from the words they all read."""

from __future__ import annotations

import statistics

import pytest

from pipeline.ranks import RidingMismatchError, Status
from pipeline.ranks.riding import TAG, _read, observed, pack, unpack
from pipeline.stages.schedule import ScheduleWatch
from pipeline.stages.watch import WatchPhase


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Blocks:
    """An input all-to-all whose wait blocks `seconds` on `clock`."""

    def __init__(self, clock: FakeClock, seconds: float) -> None:
        self._clock, self._seconds = clock, seconds

    def wait(self) -> None:
        self._clock.now += self._seconds


def simulate(
    steps: int, cost, *, ranks: int = 2, kind: type = ScheduleWatch, **settings
) -> tuple[list[ScheduleWatch], list[list[str]]]:
    """`ranks` watches stepping in lockstep. `cost(rank, schedule, step)` is `(step_s, blocked_s)`:
    the step's time and, of it, the time blocked on the input all-to-alls. Every rank's figure for a
    step's batch reaches every rank in that step, as the words in the splits all-to-all do."""
    clocks = [FakeClock() for _ in range(ranks)]
    watches = [kind(clock=c, **settings) for c in clocks]
    ran: list[list[str]] = [[] for _ in range(ranks)]
    for step in range(1, steps + 1):
        figures = []
        for r, (watch, clock) in enumerate(zip(watches, clocks, strict=True)):
            schedule = watch.step()
            ran[r].append(schedule)
            figures.append(watch.observation())
            step_s, blocked_s = cost(r, schedule, step)
            watch.waits.timed(_Blocks(clock, blocked_s).wait)
            clock.now += step_s - blocked_s
            watch.step_ended()
        for watch in watches:
            watch.received(list(figures))
    return watches, ran


def _link_bound(r: int, schedule: str, step: int) -> tuple[float, float]:
    """Under late the host blocks 45 % of a 100 ms step (under twice the threshold); early takes 70 ms."""
    return (0.100, 0.045) if schedule == "late" else (0.070, 0.010)


def test_word_round_trip_and_fields():
    word = pack(Status.MALFORMED, 1234, observed(0.42))
    f = unpack(word)
    assert (f.status, f.tag, f.rows, f.observation) == (3, TAG, 1234 % 1024, 421)
    assert 0 < word < 2**31  # torchrec's optional int32 check of the splits must pass it
    assert observed(None) == 0 and observed(0) == 1 and observed(100.0) == 4093  # under RESTORED


def test_a_step_that_waits_on_its_input_moves_to_early_and_keeps_it_where_it_pays():
    watches, ran = simulate(60, _link_bound)
    for watch, schedules in zip(watches, ran, strict=True):
        assert watch.phase is WatchPhase.KEPT and watch.schedule == "early", watch
        assert schedules[:25] == ["late"] * 25 and schedules[-1] == "early"
        # 8 warm-up steps, a window of 8, 9 figures in a row over the threshold (the last decides)
        assert schedules.count("late") == 25
        assert watch.shares == pytest.approx([0.45, 0.45]) and watch.ratios == pytest.approx([0.7, 0.7])
    text = repr(watches[0])
    assert "step 25" in text and "trying early" in text and "kept early" in text and "45%" in text
    assert "pipeline_input_dist" in watches[0].decisions[0][1]  # the process group it creates
    assert "backward; at least 25% for 9 figures in a row)" in watches[0].decisions[0][1]


def test_where_early_does_not_pay_it_goes_back_once_and_never_tries_again():
    def cost(r, schedule, step):
        return (0.100, 0.060) if schedule == "late" else (0.101, 0.010)

    watches, ran = simulate(200, cost, retries=0)  # one trial (the default tries an unsure one again)
    for watch, schedules in zip(watches, ran, strict=True):
        assert watch.phase is WatchPhase.BACK and watch.schedule == "late"
        tried = schedules.count("early")
        # settle, the verification (10 steps, none faster: clear), the step whose start reads the verdict
        assert tried == 2 + 10 + 1
        assert schedules[-100:] == ["late"] * 100
        assert watch.tuning_steps_by_schedule == {"early": tried}
    assert "back to late" in watches[0].reason and "no second try" in watches[0].reason


def test_an_unsure_verdict_is_tried_again_later_and_a_clear_loss_is_final():
    """Early 1 % slower: unsure (no rank 5 % slower), so every rank watches again and tries it after
    32 steps, then 64, 3 trials in all, each going back; then never again. Early 10 % slower is a
    clear loss: one trial. Its twin, `retries=0`, is the test above."""

    def cost(slower):
        return lambda r, schedule, step: (0.100, 0.060) if schedule == "late" else (slower, 0.010)

    watches, ran = simulate(400, cost(0.101))
    assert ran[0] == ran[1] and ran[0][-100:] == ["late"] * 100
    for watch in watches:
        assert watch.phase is WatchPhase.BACK and watch.tries == 3, watch
        assert watch.tuning_steps_by_schedule == {"early": 3 * (2 + 10 + 1)}
        _, (back, text), (again, _) = watch.decisions[:3]
        assert "once more from step" in text and f"step {back + 32}" in text and "try 2 of at most 3" in text
        assert again >= back + 32 and watch.decisions[3][0] > again  # the second verdict, then the third try
        assert watch.decisions[5][0] >= watch.decisions[3][0] + 64, watch.decisions  # twice the wait
    assert "no further try (3 tries)" in watches[0].reason
    watches, ran = simulate(400, cost(0.110))
    assert all(w.phase is WatchPhase.BACK and w.tries == 1 for w in watches)
    assert ran[0].count("early") == 2 + 10 + 1 and "no second try" in watches[0].reason


def test_a_gain_that_one_noisy_trial_missed_is_kept_at_the_next():
    """Early pays 15 %, but through the first trial's steps the machine is slow under early (no
    a 2 % loss shows: unsure). The next trial, 32 steps on, sees the gain and keeps early on every rank
    at the same step. Twin: `retries=0` stays in torchrec's order for good."""

    def cost(r, schedule, step):
        if schedule == "late":
            return 0.100, 0.060
        return (0.102 if step < 60 else 0.085), 0.010

    watches, ran = simulate(160, cost)
    assert ran[0] == ran[1] and ran[0][-1] == "early"
    assert all(w.phase is WatchPhase.KEPT and w.tries == 2 for w in watches), [w.reason for w in watches]
    assert watches[0].ratios == pytest.approx([0.85, 0.85]) and "kept early" in watches[0].reason
    assert watches[0].tuning_steps_by_schedule == {"early": 2 + 10 + 1}  # the first trial's
    watches, ran = simulate(160, cost, retries=0)
    assert ran[0][-100:] == ["late"] * 100 and all(w.phase is WatchPhase.BACK for w in watches)


def test_nothing_changes_where_nothing_waits():
    watches, ran = simulate(200, lambda r, s, step: (0.010, 0.002))  # 20 % blocked: loopback-like
    assert all(s == ["late"] * 200 for s in ran)
    assert all(w.phase is WatchPhase.WATCHING and w.share == pytest.approx(0.2) for w in watches)


def test_the_ranks_decide_on_their_mean_share_alike():
    def cost(r, schedule, step):  # rank 0 blocks 40 %, rank 1 none: mean 20 %
        if schedule == "early":
            return 0.05, 0.0
        return (0.1, 0.04) if r == 0 else (0.1, 0.0)

    _, ran = simulate(100, cost)
    assert ran[0] == ran[1] == ["late"] * 100  # under the threshold of 25 %: neither rank moves
    _, ran = simulate(100, cost, threshold=0.15)
    assert ran[0] == ran[1] and "early" in ran[0]


def test_noisy_steps_no_faster_after_the_switch_go_back():
    """Steps alternating 10 and 30 ms before the switch and 30 and 10 ms after: the medians of each
    side's faster half may differ by chance, but the pairs of a step after and a step before show
    no gain (their median ratio is 1). Twin: every step after shorter, kept."""

    def cost(r, schedule, step):
        if schedule == "late":
            return (0.010 if step % 2 else 0.030), 0.008
        return (0.030 if step % 2 else 0.010), 0.001

    watches, _ = simulate(80, cost, retries=0)
    for watch in watches:
        assert watch.ratios == pytest.approx([1.0, 1.0]) and watch.phase is WatchPhase.BACK, watch.reason
        assert watch.faster_steps < 0.8
    watches, _ = simulate(80, lambda r, s, step: (0.030, 0.02) if s == "late" else (0.009, 0.001))
    assert all(w.phase is WatchPhase.KEPT for w in watches)


class _EveryRankMustPass(ScheduleWatch):
    """The twin: the verdict as it was, each rank on its own median against the faster half of the
    steps before, and 75 % of its steps after shorter; kept only where every rank passes both."""

    def _observation(self) -> int:
        if self.phase is WatchPhase.TRYING and self.verified:
            ratio = min(1.99, statistics.median(self._after) / self.reference)
            share = sum(a < self.reference for a in self._after) / len(self._after)
            return observed(ratio if share >= 0.75 else ratio + 2.0)
        return super()._observation()

    def _verdict(self, ratios: list[float]) -> None:
        passed = all(r <= 1 - self.margin for r in ratios)  # an unsure rank's ratio is 2 or more
        super()._verdict(ratios if passed else [2.0] * len(ratios))


def _early(step_ms: tuple[float, ...]):
    """Late: a 100 ms step blocked 60 %; early: rank r's steps cycle through `step_ms[r]`."""

    def cost(r, schedule, step):
        if schedule == "late":
            return 0.100, 0.060
        cycle = step_ms[r]
        return cycle[step % len(cycle)] / 1e3, 0.010

    return cost


def test_a_gain_on_the_jobs_mean_is_kept_when_one_ranks_window_is_noisy():
    """Early pays 10 %: rank 0 sees 90 ms steps, rank 1 the same through a noisy clock (72 and 108
    ms in turn). Kept: the job's ratio is the ranks' mean. Twin: the rule that each rank must pass
    on its own goes back (half of rank 1's steps after are longer than the steps before)."""
    cost = _early(((90,), (72, 108)))
    watches, ran = simulate(100, cost)
    assert all(w.phase is WatchPhase.KEPT for w in watches) and ran[0] == ran[1], [w.reason for w in watches]
    assert statistics.fmean(watches[0].ratios) == pytest.approx(0.9, abs=0.01)
    watches, _ = simulate(100, cost, kind=_EveryRankMustPass)
    assert all(w.phase is WatchPhase.BACK for w in watches)


@pytest.mark.parametrize(
    "step_ms",
    [((105,), (105,)), ((96, 114), (105,)), ((80,), (125,)), ((90,), (104,))],
    ids=["loses-5", "loses-5-noisy", "helps-one-hurts-the-job", "helps-one-job-under-the-margin"],
)
def test_a_switch_that_does_not_pay_the_job_goes_back(step_ms):
    """A 5 % loss, also through a noisy clock; early 20 % faster on rank 0 and 25 % slower on rank 1
    (the job is slower); 10 % faster on one, 4 % slower on the other (the job's gain is under the
    margin): back, on every rank alike."""
    watches, ran = simulate(120, _early(step_ms), retries=0)
    assert ran[0] == ran[1] and "early" in ran[0] and ran[0][-1] == "late"
    assert all(w.phase is WatchPhase.BACK for w in watches), [w.ratios for w in watches]


def test_a_burst_of_waiting_is_not_a_steady_wait():
    def burst(steps: int):  # 40 % blocked on `steps` steps from step 30, else 0.5 %
        def cost(r, schedule, step):
            blocked = 0.040 if 30 <= step < 30 + steps else 0.0005
            return (0.100, blocked) if schedule == "late" else (0.05, 0.0)

        return cost

    # 9 steps: the 8-step medians over 25 % (5 steps of a window) do not last 9 batches in a row
    _, ran = simulate(100, burst(9))
    assert ran[0] == ["late"] * 100
    _, ran = simulate(100, burst(10))  # the twin: a step longer, and it moves
    assert "early" in ran[0]


def test_a_watch_with_nothing_to_hide_ends_after_its_patience():
    """20 % blocked (under the 25 % threshold) from the first figure: after 30 figures in a row
    every rank pins torchrec's order at the same step, and its clocks stop. A burst over the
    threshold (6 figures, too short to move it) starts the count again. Twin: patience 0 watches
    for ever."""
    quiet = lambda r, s, step: (0.010, 0.002)  # noqa: E731
    watches, ran = simulate(100, quiet, patience=30)
    assert all(s == ["late"] * 100 for s in ran)
    assert all(w.phase is WatchPhase.PINNED and w.choice == "late" for w in watches)
    (step, text), (other_step, _) = watches[0].decisions[-1], watches[1].decisions[-1]
    assert step == other_step and "nothing to hide" in text and "30 figures" in text, text
    assert watches[0].active_clock is None  # nothing is timed from then on

    def burst(r, schedule, step):  # 60 % blocked on steps 30-34: 6 figures over 25 %
        return (0.010, 0.006 if 30 <= step < 35 else 0.002)

    (late, _), _ = simulate(100, burst, patience=30)
    assert late.decisions[-1][0] > step + 12, late.decisions  # counted again after the burst

    watches, _ = simulate(100, quiet, patience=0)
    assert all(w.phase is WatchPhase.WATCHING for w in watches)
    assert "ends after" not in repr(watches[0])
    watches, _ = simulate(20, quiet, patience=30)  # still watching: `print(pipe.tuner)` says when it ends
    assert "ends after 30 batches in a row under it" in repr(watches[0]), repr(watches[0])


def _slow_patch(r: int, schedule: str, step: int) -> tuple[float, float]:
    """Loopback-like: under late a 10 ms step blocks 20 %; from step 40 to 59 the machine is slow
    (16 ms, 45 % blocked: the ranks wait on each other). Early takes 12 ms: it does not pay."""
    if schedule == "early":
        return 0.012, 0.001
    return (0.016, 0.0072) if 40 <= step < 60 else (0.010, 0.002)


def test_a_slow_patch_of_the_machine_before_the_switch_is_not_a_gain(monkeypatch):
    """The slow patch moves it to early; most steps before the switch are slow, and early (slower
    than a normal late step) would pass against them. Each side is read by its faster half, the
    normal late steps: early goes back. Twin: against every step before, early is kept where it
    does not pay."""
    from pipeline.stages import watch as step_times

    watches, ran = simulate(120, _slow_patch)
    assert ran[0] == ran[1] and "early" in ran[0] and ran[0][-1] == "late"
    assert all(w.phase is WatchPhase.BACK for w in watches), [w.ratios for w in watches]

    monkeypatch.setattr(step_times, "_faster_half", lambda steps: steps)
    watches, ran = simulate(120, _slow_patch)
    assert ran[0][-1] == "early" and watches[0].phase is WatchPhase.KEPT


def test_a_rank_without_a_full_window_holds_the_decision():
    watches = [ScheduleWatch(clock=FakeClock()) for _ in range(2)]
    for w in watches:
        w.received([observed(0.9), 0])  # one rank has no figure yet
    assert all(w.phase is WatchPhase.WATCHING for w in watches)


def test_a_decided_watch_reads_no_clock():
    def no_clock() -> float:
        raise AssertionError("the clock was read after the decision")

    watch = ScheduleWatch(clock=no_clock)
    watch.pin("one rank")
    assert [watch.step() for _ in range(3)] == ["late"] * 3 and watch.active_clock is None
    assert watch.choice == "late" and "one rank" in watch.reason


@pytest.mark.parametrize("verdict", ["kept", "back", "pinned"])
def test_once_decided_neither_a_steps_start_nor_its_end_reads_the_clock(verdict):
    """A watch that timed steps, then decided: no clock is read at either end of a step after the
    step that applied the decision."""
    clock, reads = FakeClock(), [0]

    def counted() -> float:
        reads[0] += 1
        return clock()

    cost = _link_bound if verdict == "kept" else (lambda r, s, step: (0.100, 0.060))
    watches, _ = simulate(20 if verdict == "pinned" else 80, cost, ranks=1, retries=0)
    watch = watches[0]
    if verdict == "pinned":
        watch.pin("a test")
    assert watch.phase.value == verdict, watch
    watch.clock = counted
    watch.step()  # applies a pending mode
    watch.step_ended()
    before = reads[0]
    for _ in range(5):
        watch.step()
        watch.step_ended()
    assert reads[0] == before, f"{reads[0] - before} clock reads after the decision"


def test_state_dict_keeps_the_decision_and_a_restarted_job_does_not_try_again():
    watches, _ = simulate(60, _link_bound)
    state = watches[0].state_dict()
    restored = ScheduleWatch(clock=lambda: (_ for _ in ()).throw(AssertionError("clock read")))
    restored.load_state_dict(state)
    assert restored.step() == "early" and restored.phase is WatchPhase.KEPT
    assert restored.decisions == watches[0].decisions
    midway = ScheduleWatch(clock=FakeClock())
    midway.load_state_dict(ScheduleWatch(clock=FakeClock()).state_dict())  # saved while watching
    assert midway.phase is WatchPhase.WATCHING


def _ten_ms_step(watch: ScheduleWatch, clock: FakeClock) -> None:
    watch.step()
    clock.now += 0.010
    watch.step_ended()


def test_an_eval_step_is_not_timed():
    clock = FakeClock()
    watch = ScheduleWatch(clock=clock, warmup=0, window=3)
    for _ in range(3):
        _ten_ms_step(watch, clock)
    watch.interrupt()  # an eval step of 10 s between
    clock.now += 10
    _ten_ms_step(watch, clock)
    watch.step()
    assert watch.share == 0.0 and max(s for s, _ in watch._samples) < 1


def test_the_time_between_two_steps_is_not_a_step():
    """A checkpoint save, an outside eval loop or the end of the data between two `progress()`
    calls: the step is timed from its start to its end, not to the next step's start."""
    clock = FakeClock()
    watch = ScheduleWatch(clock=clock, warmup=0, window=3)
    for i in range(6):
        _ten_ms_step(watch, clock)
        clock.now += 5.0 if i == 2 else 0.0  # a checkpoint saved between steps 3 and 4
    assert max(s for s, _ in watch._samples) == pytest.approx(0.010)


def test_rejects_bad_settings():
    with pytest.raises(ValueError, match="bad watch settings"):
        ScheduleWatch(threshold=1.5)
    with pytest.raises(ValueError, match="bad watch settings"):
        ScheduleWatch(sure=1.2)


@pytest.mark.parametrize("setting", ["window", "verify"])
def test_a_negative_window_is_named_as_a_bad_setting(setting):
    # checked before the windows are sized: a deque's own error would not say which setting is wrong
    with pytest.raises(ValueError, match=f"bad watch settings: .*{setting} -1"):
        ScheduleWatch(**{setting: -1})


# -- the receiver's check of what rides ---------------------------------------------------------


def test_words_of_the_same_row_count_are_read():
    statuses, figures = _read([pack(Status.HAVE, 7, 5), pack(Status.EXHAUSTED, 7, 0)], 7, index=3)
    assert statuses == [Status.HAVE, Status.EXHAUSTED] and figures == [5, 0]


@pytest.mark.parametrize(
    ("words", "said"),
    [
        ([pack(Status.HAVE, 7), pack(Status.HAVE, 8)], "rank 1: a status word after 8 splits rows"),
        ([pack(Status.HAVE, 7), 256], "rank 1: not a status word"),  # a split read as a status
        ([pack(Status.HAVE, 7), 1], "rank 1: not a status word"),  # a split of 1 would read as HAVE
    ],
)
def test_a_row_that_is_not_the_same_status_word_is_an_error_naming_the_rank(words, said):
    with pytest.raises(RidingMismatchError, match=said) as caught:
        _read(words, 7, index=3)
    assert "batch 3" in str(caught.value) and "after 7 splits rows" in str(caught.value)


# -- a restored decision, on simulated ranks whose checkpoints differ ----------------------------


def _restored(loads: tuple[bool, ...], monkeypatch, *, agreed: bool) -> list[list[str]]:
    """Ranks that each load a kept "early" (`loads`), or nothing, then step in lockstep with nothing
    to wait for; `agreed=False` is the twin: each rank takes its state alone, as before."""
    from pipeline.stages import watch as step_watch
    from pipeline.stages.watch import SavedDecision

    modes, final = ScheduleWatch.modes, ("kept", "back", "pinned")
    monkeypatch.setattr(step_watch, "world_size", lambda: len(loads))
    state = {"phase": "kept", "mode": "early", "decisions": [(40, "kept early")], "world_size": len(loads)}
    clocks = [FakeClock() for _ in loads]
    watches = [ScheduleWatch(clock=c, warmup=0, window=3) for c in clocks]
    for watch, load in zip(watches, loads, strict=True):
        if load:
            watch.load_state_dict(state) if agreed else watch._take(SavedDecision.parse(state, modes, final))
    ran: list[list[str]] = [[] for _ in loads]
    for _ in range(12):
        figures = []
        for r, (watch, clock) in enumerate(zip(watches, clocks, strict=True)):
            ran[r].append(watch.step())
            figures.append(watch.observation())
            clock.now += 0.1
            watch.step_ended()
        for watch in watches:
            watch.received(list(figures))
    return ran


@pytest.mark.parametrize("loads", [(True, False), (False, True, True), (True, True, True)])
def test_ranks_whose_restored_states_differ_still_run_alike(loads, monkeypatch):
    ran = _restored(loads, monkeypatch, agreed=True)
    assert all(r == ran[0] for r in ran), ran
    assert ("early" in ran[0]) is all(loads) and ran[0][0] == "late"


@pytest.mark.parametrize("loads", [(True, False), (False, True, True)])
def test_twin_ranks_that_take_their_own_states_split(loads, monkeypatch):
    ran = _restored(loads, monkeypatch, agreed=False)
    assert any(r != ran[0] for r in ran), "the twin should split the ranks: the scenario tests nothing"


def test_a_decision_saved_at_another_world_size_is_not_taken(monkeypatch):
    from pipeline.stages import watch as step_watch

    monkeypatch.setattr(step_watch, "world_size", lambda: 3)
    watch = ScheduleWatch(clock=FakeClock())
    watch.load_state_dict({"phase": "kept", "mode": "early", "decisions": [], "world_size": 2})
    assert watch.phase is WatchPhase.WATCHING and watch.observation() == 0
    assert "saved at world size 2" in watch.reason and "watching again" in watch.reason


def test_where_no_splits_group_spans_every_rank_the_watches_are_pinned(monkeypatch):
    """2D sharding: every fused splits all-to-all runs on a subgroup, so nothing rides; the watch
    says why and stops its clocks instead of reporting "watching" for ever."""
    from pipeline.ranks import riding

    class Ranks:
        voting, carrying = True, False

    watch = ScheduleWatch(clock=FakeClock())
    admission = riding.Admission(Ranks(), True, watch=watch)
    monkeypatch.setattr(riding, "splits_shape", lambda fused: None)
    admission.learn([(["ebc"], object())])  # a fused all-to-all (on a subgroup: no shape)
    assert watch.phase is WatchPhase.PINNED and watch.active_clock is None
    assert "spans every rank" in watch.reason and not admission.enabled


def test_a_settled_watch_is_not_called_by_the_steps_but_still_counts_them(monkeypatch):
    """Once decided and applied (pinned here: one process), the step calls none of the watch's
    `step`, `step_ended` or `interrupt`, and the watch still counts the training steps; a loaded
    state wakes it (its next `step` runs). The twin: with `settled` never set, every step calls it."""
    import torch

    import pipeline
    from pipeline.stages.watch import StepWatch
    from tests.test_torchrec_parity import _Echo, _Numbered

    def run(settles: bool) -> tuple[int, int, object]:
        calls = {"step": 0, "step_ended": 0}
        for name in calls:
            original = getattr(StepWatch, name)

            def counted(self, _original=original, _name=name):
                calls[_name] += 1
                result = _original(self)
                if not settles:
                    self.settled = False
                return result

            monkeypatch.setattr(StepWatch, name, counted)
        model = _Echo()
        pipe = pipeline.TrainPipelineSparseDist(
            model, torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu")
        )
        it = iter([_Numbered(i) for i in range(12)])
        for _ in range(10):
            pipe.progress(it)
        return calls["step"], calls["step_ended"], pipe

    steps, ended, pipe = run(settles=True)
    assert pipe.tuner.settled and pipe.tuner.phase is WatchPhase.PINNED
    assert (steps, ended) == (1, 0) and pipe.tuner.steps == 10  # the first step settles it
    pipe.tuner.load_state_dict(pipe.tuner.state_dict())
    assert not pipe.tuner.settled
    assert run(settles=False)[:2] == (10, 10)
