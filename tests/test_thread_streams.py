"""ThreadStreams: the CPU prefetch stream as a worker thread (pipeline/stages/thread_streams.py)."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch

from pipeline.stages.streams import Streams, ThreadStreams, streams_for
from tests.streamcheck import RecordingStreams


def test_work_runs_in_order_on_another_thread_and_handoff_waits():
    streams = ThreadStreams()
    seen: list[tuple[int, str]] = []

    def work(i: int):
        def run():
            time.sleep(0.02 * (3 - i))  # earlier work takes longer: order must still hold
            seen.append((i, threading.current_thread().name))

        return run

    futures = [streams.submit(streams.prefetch, work(i)) for i in range(3)]
    streams.handoff(object(), streams.prefetch)  # waits for everything submitted so far
    assert [i for i, _ in seen] == [0, 1, 2]
    assert all(name.startswith("pipeline-prefetch") for _, name in seen)
    assert all(f.done() for f in futures)


def test_handoff_of_a_produced_object_waits_for_its_own_work_only():
    # forward of batch i takes the input that the prefetch of i made while the prefetch of i+1,
    # submitted before forward of i, still runs: the hand-off must not wait for i+1
    streams = ThreadStreams()
    made, release = object(), threading.Event()

    def first():
        streams.produced(made)

    def second():
        assert release.wait(10)

    streams.submit(streams.prefetch, first).result()
    later = streams.submit(streams.prefetch, second)
    started = time.perf_counter()
    streams.handoff(made, streams.prefetch)
    assert time.perf_counter() - started < 1.0 and not later.done()
    release.set()
    streams.handoff(object(), streams.prefetch)  # not produced there: waits for everything
    assert later.done()


def test_an_error_on_the_worker_surfaces_at_the_consumer_and_drain_clears_it():
    streams = ThreadStreams()

    def fail():
        raise ValueError("bad batch")

    future = streams.submit(streams.prefetch, fail)
    with pytest.raises(ValueError, match="bad batch"):
        future.result()
    with pytest.raises(ValueError, match="bad batch"):
        streams.handoff(object(), streams.prefetch)
    streams.discard()  # a reset drops the error instead of raising it again
    # the stream takes new work after it, and a hand-off waits for that work only
    ran = []
    streams.submit(streams.prefetch, lambda: ran.append(1))
    streams.handoff(object(), streams.prefetch)
    assert ran == [1]


@pytest.mark.parametrize("how", ["wait_all", "discard"])
def test_waiting_for_all_work_waits_for_running_work(how):
    streams = ThreadStreams()
    release, done = threading.Event(), []
    streams.submit(streams.prefetch, lambda: done.append(release.wait(10)))
    threading.Timer(0.2, release.set).start()
    getattr(streams, how)()
    assert done == [True], f"{how}() returned before the work it must wait for"


def _failing_then_counting(streams: ThreadStreams) -> list[int]:
    ran: list[int] = []

    def fail():
        raise ValueError("bad batch")

    streams.submit(streams.prefetch, fail)
    streams.submit(streams.prefetch, lambda: ran.append(1))
    return ran


def test_wait_all_raises_an_error_nothing_raised_yet_and_only_once():
    streams = ThreadStreams()
    ran = _failing_then_counting(streams)
    with pytest.raises(ValueError, match="bad batch"):
        streams.wait_all()
    assert ran == [1], "the work after the failed one did not run"
    streams.wait_all()  # the error was raised: a second wait has nothing to raise


def test_discard_drops_the_error_for_a_later_handoff():
    """`discard()`: wait for all submitted work and drop its errors. Neither a hand-off right after
    it, before any new work, nor a later `wait_all()` raises the dropped error."""
    streams = ThreadStreams()
    ran = _failing_then_counting(streams)
    streams.discard()
    assert ran == [1]
    streams.handoff(object(), streams.prefetch)
    streams.wait_all()
    streams.submit(streams.prefetch, lambda: ran.append(2))
    streams.handoff(object(), streams.prefetch)
    assert ran == [1, 2], "the stream took no new work after discard()"


def test_finished_work_is_not_kept_but_a_failed_one_is_until_raised():
    """The Prefetch pipeline submits a job a step, for days: the stream keeps no job that finished
    without error. A failed one is kept (the negative twin) until `wait_all()` raises its error."""
    streams = ThreadStreams()

    def fail():
        raise ValueError("bad batch")

    jobs = [streams.submit(streams.prefetch, fail if i == 30 else lambda: None) for i in range(50)]
    refs = [weakref.ref(job) for job in jobs]
    del jobs
    streams.prefetch.join()  # the last job: succeeded
    streams.submit(streams.prefetch, lambda: None)  # a submission drops the finished ones
    streams.prefetch.join()
    gc.collect()
    kept = [i for i, ref in enumerate(refs) if ref() is not None]
    assert 30 in kept, f"the failed job was dropped before its error was raised: kept {kept}"
    assert min(kept) == 30, f"finished jobs before the failed one were kept: {kept}"
    with pytest.raises(ValueError, match="bad batch"):
        streams.wait_all()
    streams.submit(streams.prefetch, lambda: None)
    streams.prefetch.join()
    streams.submit(streams.prefetch, lambda: None)
    gc.collect()
    assert all(ref() is None for ref in refs), "jobs were kept after wait_all() raised their error"


def test_under_the_profiler_work_stays_on_the_calling_thread():
    streams = ThreadStreams()
    names = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        streams.submit(streams.prefetch, lambda: names.append(threading.current_thread().name)).result()
    assert names == [threading.current_thread().name]


def test_a_profiler_of_every_thread_sees_the_work_on_the_worker():
    from torch._C._profiler import _ExperimentalConfig

    from pipeline.stages.streams import profiling_all_threads

    streams = ThreadStreams()
    names = []

    def work():
        names.append(threading.current_thread().name)
        with torch.profiler.record_function("pipeline::prefetch#7"):
            torch.ones(4).sum()

    config = _ExperimentalConfig(profile_all_threads=True)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], experimental_config=config
    ) as p:
        with profiling_all_threads():
            streams.submit(streams.prefetch, work).result()
    assert names[0].startswith("pipeline-prefetch")
    assert "pipeline::prefetch#7" in [e.name for e in p.events()]


def test_default_streams_per_device():
    assert type(streams_for(torch.device("cpu"))) is Streams
    assert type(streams_for(torch.device("cpu"), prefetch_thread=True)) is ThreadStreams
    recording = RecordingStreams()
    recording.submit(recording.prefetch, lambda: recording.stage_started("prefetch"))
    assert recording.stage_streams() == {"prefetch": {"prefetch"}}
