"""The keep-alive of the hand-offs (pipeline/stages/keepalive.py, one process): objects handed to a
consumer stream are dropped only after the event the consumer recorded at their release completed;
the in-place copy holds what the copy stream writes; the record_stream switch holds nothing."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from pipeline.pipelines.core import to_device_in_place
from pipeline.stages.streams import KeepAlive, OrderedStreams
from tests.streamcheck import HandoffError, RecordingStreams


class _Event:
    """Completes when the test says so."""

    def __init__(self) -> None:
        self.done, self.stream = False, None

    def record(self, stream) -> None:
        self.done, self.stream = False, stream

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


class _Thing:
    """A weak-referenceable stand-in for a batch."""


def _held(n: int) -> tuple[KeepAlive, list[_Event], list]:
    events: list[_Event] = []

    def new_event() -> _Event:
        events.append(_Event())
        return events[-1]

    keep = KeepAlive(new_event)
    refs = []
    for i in range(n):
        thing = _Thing()
        keep.hold(thing, "default", owner=i)
        refs.append(weakref.ref(thing))
    return keep, events, refs


def test_an_object_lives_until_the_event_of_its_release_completed():
    keep, events, refs = _held(1)
    gc.collect()
    assert refs[0]() is not None, "dropped while held (not released yet)"
    keep.release(0)
    keep.poll()
    gc.collect()
    assert refs[0]() is not None, "dropped before the consumer's event completed"
    events[0].done = True
    keep.poll()
    gc.collect()
    assert refs[0]() is None and keep.size == 0, "kept after its event completed"


def test_poll_never_waits_and_drops_in_order_per_stream():
    keep, events, _ = _held(2)
    keep.release(0)
    keep.release(1)
    events[1].done = True  # a later event on the same stream cannot be done before an earlier one
    keep.poll()
    assert keep.size == 2, "poll dropped past an event that had not completed"
    events[0].done = True
    keep.poll()
    assert keep.size == 0 and keep.peak == 2


def test_wait_keeps_what_batches_in_flight_hold_and_release_all_drops_everything():
    keep, _, refs = _held(2)
    keep.release(0)
    keep.wait()
    assert keep.size == 1, "wait() must drop the released object and keep the one in flight"
    keep.release_all()
    gc.collect()
    assert keep.size == 0 and all(r() is None for r in refs), "release_all() left objects kept"


def test_events_are_reused_once_completed():
    keep, events, _ = _held(3)
    for owner in range(3):
        keep.release(owner)
        keep.wait()
    assert len(events) == 1, f"{len(events)} events made for three releases one after the other"


def test_a_handoff_of_an_object_needs_an_owner_and_the_mode_is_checked():
    streams = RecordingStreams()
    with streams.use(streams.data_dist), pytest.raises(ValueError, match="owner"):
        streams.handoff(torch.ones(1), streams.memcpy)
    with pytest.raises(ValueError, match="handoff must be one of"):
        OrderedStreams(_Event, handoff="later")


def test_the_record_stream_switch_records_and_holds_nothing():
    streams = RecordingStreams(handoff="record-stream")
    batch, owner = torch.ones(2), object()
    with streams.use(streams.memcpy):
        streams.produced(batch)
    streams.handoff(batch, streams.memcpy, owner)
    streams.consumed(batch)
    streams.release(owner)
    assert streams.kept == 0 and ("record", id(batch), "default") in streams.log
    assert streams.check() == 1


def test_the_in_place_copy_holds_its_destination_for_the_copy_stream():
    streams = RecordingStreams()
    batch = {"dense": torch.ones(3), "ids": [torch.arange(4)]}
    with streams.watch():
        out = to_device_in_place(batch, torch.device("cpu"), streams)
    assert torch.equal(out["dense"], batch["dense"]) and torch.equal(out["ids"][0], batch["ids"][0])
    log = streams.log
    fence = log.index(("wait", "memcpy", "default"))
    hold = log.index(("hold", id(out), "memcpy"))
    assert fence < hold < log.index(("release", id(out), "memcpy", 1)), log
    assert streams.uses_checked >= 2, "the copies were not seen writing the held destination"
    streams.check()
    streams.wait_all()
    streams.check_drained()


def test_a_copy_after_the_release_is_caught():
    streams = RecordingStreams()
    out, owner = torch.empty(3), object()
    streams.handoff(out, streams.memcpy, owner)
    streams.release(owner)
    with streams.watch():
        out.copy_(torch.ones(3))  # on the default stream, which released it
    with pytest.raises(HandoffError, match="after its release"):
        streams.check()
