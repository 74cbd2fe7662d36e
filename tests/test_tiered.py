"""Unit tests of the tiered kernel's store and cache (no process group): write-back on eviction,
pinning, the too-small-cache error, eviction policies, and store files that are never half-written."""

from __future__ import annotations

import gc

import pytest
import torch

from tiered import CacheTooSmallError, RowCache, RowStore, StoreError, TieredOptions, make_policy

ROWS, DIM = 100, 4


def _fill(block: torch.Tensor) -> None:
    block.copy_(torch.arange(block.numel(), dtype=torch.float32).view_as(block))


def _store(tmp_path, state_width: int = 1) -> RowStore:
    return RowStore.create(tmp_path / "t.rows", ROWS, DIM, state_width, lambda b: b.normal_())


def _cache(tmp_path, capacity: int, policy: str = "lru") -> RowCache:
    store = _store(tmp_path)
    return RowCache(store, capacity, make_policy(policy, capacity, ROWS), name="t")


def test_store_round_trip_in_runs(tmp_path):
    store = _store(tmp_path)
    rows = torch.tensor([0, 1, 2, 7, 50, 51, 99])
    before = store.weights()[rows].clone()
    weights, state = store.read(rows)
    assert torch.equal(weights, before) and torch.equal(state, torch.zeros(7, 1))
    store.write(rows, weights + 1, state + 2)
    weights2, state2 = store.read(rows)
    assert torch.equal(weights2, before + 1) and torch.equal(state2, torch.full((7, 1), 2.0))
    assert store.stats.rows_read == 14 and store.stats.rows_written == 7
    assert store.stats.bytes_read == 14 * (DIM + 1) * 4


@pytest.mark.parametrize("cold", [False, True])
def test_store_reads_and_writes_scattered_rows_through_the_mapping(tmp_path, cold):
    # 256-byte rows, 3000 of 20000 at random: runs of neighbours, lone rows, pages shared by rows,
    # through the page cache or not
    store = RowStore.create(tmp_path / "big.rows", 20_000, 64, 1, lambda b: b.normal_(), cold=cold)
    gen = torch.Generator().manual_seed(0)
    rows = torch.randperm(20_000, generator=gen)[:3000].sort().values
    weights, state = store.read(rows)
    assert torch.equal(weights, store.weights()[rows]) and torch.equal(state, torch.zeros(3000, 1))
    new_w, new_s = torch.randn(3000, 64, generator=gen), torch.randn(3000, 1, generator=gen)
    store.write(rows, new_w, new_s)
    weights, state = store.read(rows)
    assert torch.equal(weights, new_w) and torch.equal(state, new_s)
    untouched = torch.ones(20_000, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(store.state()[untouched], torch.zeros(int(untouched.sum()), 1))


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_reading_a_store_does_not_grow_the_resident_set(tmp_path):
    # 64 MiB of rows read in full, a chunk at a time: the pages are unmapped after every read
    store = RowStore.create(tmp_path / "big.rows", 256_000, 64, 0, lambda b: b.fill_(1.0))
    store.read(torch.arange(10))
    before = _rss_kib()
    for start in range(0, 256_000, 16_000):
        weights, _ = store.read(torch.arange(start, start + 16_000))
        assert weights.sum().item() == 16_000 * 64
    del weights
    assert _rss_kib() - before < 16 * 1024, "pages read through the mapping stay resident"


class _SlowWrites:
    """Holds the store's writer thread inside its first write until `go` is set."""

    def __init__(self, store: RowStore) -> None:
        import threading

        self.go, self.store, self._real = threading.Event(), store, store._queue._write_now
        store._queue._write_now = self._write

    def _write(self, *args) -> None:
        assert self.go.wait(30)
        self._real(*args)


def test_store_writes_behind_and_reads_see_queued_rows(tmp_path):
    store = _store(tmp_path)
    before = store.weights().clone()
    slow = _SlowWrites(store)
    first, second = torch.tensor([3, 4, 5]), torch.tensor([4, 9])
    store.write(first, torch.full((3, DIM), 1.0), torch.full((3, 1), 1.0))  # returns at once
    store.write(second, torch.full((2, DIM), 2.0), torch.full((2, 1), 2.0))
    on_disk = RowStore.open(tmp_path / "t.rows", ROWS, DIM, 1)  # the file, bypassing the queue
    assert torch.equal(on_disk.read(torch.tensor([3, 4, 9]))[0], before[[3, 4, 9]])
    weights, state = store.read(torch.tensor([2, 3, 4, 9]))  # the newest queued value wins
    assert torch.equal(weights[0], before[2]) and weights[1:, 0].tolist() == [1.0, 2.0, 2.0]
    assert state[:, 0].tolist() == [0.0, 1.0, 2.0, 2.0]
    slow.go.set()
    store.sync()
    assert store._queue._queued == []
    weights = on_disk.read(torch.tensor([3, 4, 5, 9]))[0]
    assert weights[:, 0].tolist() == [1.0, 2.0, 1.0, 2.0]  # written in order: row 4 ends at 2.0


@pytest.mark.parametrize("owned", [True, False])
def test_an_owned_write_is_queued_without_a_copy(tmp_path, owned):
    """`owned=True` queues the caller's arrays as they are (a change made after the write shows in
    a read of the queued row: the proof that nothing was copied); the default copies them."""
    store = _store(tmp_path)
    slow = _SlowWrites(store)
    weights, state = torch.full((2, DIM), 1.0), torch.full((2, 1), 1.0)
    store.write(torch.tensor([3, 4]), weights, state, owned=owned)
    weights += 1.0
    read = store.read(torch.tensor([3]))[0][0, 0].item()
    assert read == (2.0 if owned else 1.0), f"owned={owned}: a queued row reads {read}"
    slow.go.set()
    store.sync()


def test_cache_hands_its_evicted_rows_to_the_store_without_a_second_copy(tmp_path):
    cache = _cache(tmp_path, 2)
    calls = []
    real = cache.store.write
    cache.store.write = lambda *args, **kwargs: calls.append(kwargs) or real(*args, **kwargs)
    pin = cache.acquire(torch.tensor([1, 2]))
    cache.mark_dirty(pin.unique_slots)
    pin.release()
    cache.acquire(torch.tensor([5, 6])).release()  # evicts the dirty rows 1 and 2
    assert calls == [{"owned": True}], f"the write-back's store.write calls: {calls}"


def _zero(block):
    block.zero_()


def test_stores_write_behind_on_the_ranks_share_of_writer_threads(tmp_path, monkeypatch):
    """As many writer threads per process as the rank's share of the cores, whatever the number of
    stores (a thread per store put as many runnable threads as table shards beside the training
    thread), each store's writes on one of them."""
    import os
    import threading

    from tiered import writer

    for cores, expected in (({0}, 1), ({0, 1}, 2)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, cores=cores: cores)
        monkeypatch.setattr(writer, "_executors", [])
        stores = [RowStore.create(tmp_path / f"s{len(cores)}{i}.rows", ROWS, DIM, 1, _zero) for i in range(4)]
        names = {}
        for i, store in enumerate(stores):
            for v in (i, 10 + i):  # two writes a store: the later one lands last
                store.write(torch.tensor([i]), torch.full((1, DIM), float(v)), torch.zeros(1, 1))
                names.setdefault(i, set()).add(
                    writer.submit_write(threading.get_ident, store._queue._writer).result()
                )
        for store in stores:
            store.sync()
        assert len(writer._executors) == expected, f"{len(writer._executors)} writers for {len(cores)} cores"
        assert all(len(n) == 1 for n in names.values()), f"a store's writes on several threads: {names}"
        assert len(set().union(*names.values())) == expected
        got = [s.read(torch.tensor([i]))[0][0, 0].item() for i, s in enumerate(stores)]
        assert got == [10.0, 11.0, 12.0, 13.0], got


def test_store_write_queue_is_bounded(tmp_path, monkeypatch):
    import threading

    import tiered.write_queue

    monkeypatch.setattr(tiered.write_queue, "WRITE_BEHIND", 2)
    store = _store(tmp_path)
    slow = _SlowWrites(store)
    for row in range(2):  # the writer holds the first in its write; both are queued
        store.write(torch.tensor([row]), torch.ones(1, DIM), torch.ones(1, 1))
    blocked = threading.Thread(
        target=store.write, args=(torch.tensor([7]), torch.ones(1, DIM), torch.ones(1, 1))
    )
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive(), "a write beyond WRITE_BEHIND must wait for the oldest"
    slow.go.set()
    blocked.join(10)
    assert not blocked.is_alive()
    store.sync()
    assert store.stats.write_wait_seconds > 0.2


def test_store_write_error_is_reported_and_rows_stay_readable(tmp_path):
    store = _store(tmp_path)

    def fail(*args) -> None:
        raise OSError(28, "No space left on device")

    store._queue._write_now = fail
    store.write(torch.tensor([1]), torch.full((1, DIM), 5.0), torch.zeros(1, 1))
    with pytest.raises(StoreError, match="No space left on device"):
        store.sync()
    assert store.read(torch.tensor([1]))[0][0, 0].item() == 5.0  # still served from the queue
    with pytest.raises(StoreError, match="free disk space"):
        store.write(torch.tensor([2]), torch.zeros(1, DIM), torch.zeros(1, 1))


def _returns_within(call, seconds: float = 10.0):
    """`call()` on a thread: its outcome ("returned", value) or ("raised", error), or ("hung", None)
    if it is still running after `seconds` (the thread is a daemon: a hang fails the test, not
    the run)."""
    import threading

    outcome: list = [("hung", None)]

    def run() -> None:
        try:
            outcome[0] = ("returned", call())
        except BaseException as e:
            outcome[0] = ("raised", e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    return outcome[0] if not thread.is_alive() else ("hung", None)


@pytest.fixture
def refuse_writes(monkeypatch):
    """Call it to make the writer threads refuse new work, as at interpreter exit (shut down)."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    from tiered import writer

    def refuse() -> None:
        stopped = ThreadPoolExecutor(max_workers=1)
        stopped.shutdown()
        monkeypatch.setattr(writer, "_executors", [stopped])
        monkeypatch.setattr(writer, "_pid", os.getpid())

    return refuse


def test_a_write_the_writers_refuse_raises_and_nothing_waits_for_it(tmp_path, refuse_writes):
    store = _store(tmp_path)
    store.write(torch.tensor([1]), torch.full((1, DIM), 3.0), torch.zeros(1, 1))
    store.sync()
    refuse_writes()
    with pytest.raises(StoreError, match="not written: the writer threads take no more work"):
        store.write(torch.tensor([2]), torch.full((1, DIM), 4.0), torch.zeros(1, 1))
    assert store._queue._queued == [], "a refused write was queued"
    assert _returns_within(store.sync) == ("returned", None)
    assert _returns_within(store.close) == ("returned", None)
    on_disk = RowStore.open(tmp_path / "t.rows", ROWS, DIM, 1).read(torch.tensor([1]))[0]
    assert on_disk[0, 0].item() == 3.0, "the write before the refusal is in the file"


def test_an_entry_queued_before_a_refused_submit_would_hang_sync(tmp_path, refuse_writes):
    """The negative twin: queued before its submit, as `write()` did, an entry whose submit is
    refused is never done, and `sync()` waits for it (the hang the test above rules out)."""
    import numpy as np

    from tiered.write_queue import _Queued
    from tiered.writer import submit_write

    store = _store(tmp_path)
    refuse_writes()
    entry = _Queued(np.array([2]), np.full((1, DIM), 4.0, np.float32), np.zeros((1, 1), np.float32))
    store._queue._queued.append(entry)
    with pytest.raises(RuntimeError, match="cannot schedule new futures"):
        submit_write(lambda: store._queue._write_queued(entry), store._queue._writer)
    assert _returns_within(store.sync, 0.5) == ("hung", None)
    entry.done.set_result(None)  # lets the waiting thread go


_AT_EXIT = """
import atexit, sys
import torch
from tiered import RowStore, StoreError

store = RowStore.create(sys.argv[1], 100, 4, 1, lambda b: b.zero_())

def flush():  # an atexit write-back: it runs after the writer threads have stopped
    try:
        store.write(torch.tensor([1]), torch.ones(1, 4), torch.zeros(1, 1))
        print("written")
    except StoreError as e:
        print("refused:", e)
    store.close()
    print("closed")

atexit.register(flush)
"""


@pytest.mark.slow  # a fresh interpreter imports torch: 3 s
def test_a_write_back_at_interpreter_exit_is_refused_and_the_process_ends(tmp_path):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _AT_EXIT, str(tmp_path / "t.rows")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "refused:" in done.stdout and "the writer threads take no more work" in done.stdout, done.stdout
    assert done.stdout.rstrip().endswith("closed"), done.stdout


def _child_checks(store: RowStore, pending, tmp_path) -> int:
    """In a forked child of a process whose store has a write queued: 0, or the number of the
    first check that failed."""
    if pending.done.done():  # the negative twin: nothing here will ever complete the parent's entry
        return 1
    try:
        pending.done.result(timeout=0.3)
        return 2
    except TimeoutError:
        pass  # what `sync()` waited on, without a timeout, before the fork was handled
    for check, call in ((3, store.sync), (4, lambda: store.read(torch.tensor([1])))):
        outcome, error = _returns_within(call, 5.0)
        if outcome != "raised" or "was forked while 1 writes" not in str(error):
            return check
    if _returns_within(store.close, 5.0) != ("returned", None):
        return 5
    fresh = RowStore.create(tmp_path / "child.rows", ROWS, DIM, 1, _zero)  # the child's own store
    fresh.write(torch.tensor([1]), torch.full((1, DIM), 9.0), torch.zeros(1, 1))
    if _returns_within(fresh.close, 10.0) != ("returned", None):
        return 6
    reopened = RowStore.open(tmp_path / "child.rows", ROWS, DIM, 1)
    return 0 if reopened.read(torch.tensor([1]))[0][0, 0].item() == 9.0 else 7


def _in_a_forked_child(check, *, timeout: float) -> int | None:
    """`check()`'s exit code in a forked child (99 if it raised), or None where the child did not
    end within `timeout` seconds (it is killed then). The child never returns into pytest."""
    import os
    import signal
    import time

    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            code = check()
        finally:
            os._exit(code)
    deadline, status = time.monotonic() + timeout, None
    while status is None and time.monotonic() < deadline:
        done, raw = os.waitpid(pid, os.WNOHANG)
        status = os.waitstatus_to_exitcode(raw) if done else None
        time.sleep(0.02)
    if status is None:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    return status


def test_a_forked_child_never_waits_on_its_parent_s_queued_writes(tmp_path):
    """The child inherits the queue, not the writer thread: it refuses the store (read, sync) with
    a clear error, closes it at once, and writes a store of its own through a writer of its own.
    The parent's queued write lands in the parent."""

    store = _store(tmp_path)
    slow = _SlowWrites(store)  # the writer holds the write: queued at the fork
    store.write(torch.tensor([1]), torch.full((1, DIM), 5.0), torch.zeros(1, 1))
    pending = store._queue._queued[-1]
    status = _in_a_forked_child(lambda: _child_checks(store, pending, tmp_path), timeout=60)
    slow.go.set()
    store.sync()
    assert status == 0, f"the forked child hung (None) or failed check {status}"
    assert store.read(torch.tensor([1]))[0][0, 0].item() == 5.0 and store._queue._queued == []


def test_cache_flush_puts_evicted_and_dirty_rows_in_the_file(tmp_path):
    cache = _cache(tmp_path, capacity=4)
    slow = _SlowWrites(cache.store)
    pin = cache.acquire(torch.tensor([0, 1, 2, 3]))
    cache.weights[pin.unique_slots] += 100.0
    cache.mark_dirty(pin.unique_slots)
    pin.release()
    cache.acquire(torch.tensor([10, 11])).release()  # evicts two dirty rows: queued, not written
    on_disk = RowStore.open(tmp_path / "t.rows", ROWS, DIM, 1)
    queued = cache.store.read(torch.tensor([0, 1, 2, 3]))[0][:, 0] > 50  # the evicted two
    assert int(queued.sum()) == 2 and not (on_disk.read(torch.tensor([0, 1, 2, 3]))[0] > 50).any()
    slow.go.set()
    cache.flush()
    assert (on_disk.read(torch.tensor([0, 1, 2, 3]))[0] > 50).all()


def test_spans_cover_every_row_once_within_their_limits():
    import numpy as np

    from tiered.pages import _spans

    ids = np.array([0, 1, 2, 10, 11, 40, 41, 200, 201, 202, 203, 204, 205])
    spans = _spans(ids, max_gap=8, max_rows=4)
    assert [i for a, b in spans for i in range(a, b)] == list(range(len(ids)))
    for a, b in spans:
        assert ids[b - 1] - ids[a] + 1 <= 4 or b - a == 1
        assert all(np.diff(ids[a:b]) <= 8)
    assert spans[0] == (0, 3) and (7, 11) in spans


def test_store_refuses_another_shape_and_missing_directory(tmp_path):
    _store(tmp_path)
    with pytest.raises(StoreError, match="another table shape"):
        RowStore.create(tmp_path / "t.rows", ROWS, DIM + 1, 1, _fill)
    with pytest.raises(StoreError, match="another table shape"):
        RowStore.open(tmp_path / "t.rows", ROWS + 1, DIM, 1)
    with pytest.raises(StoreError, match="does not exist"):
        RowStore.create(tmp_path / "nope" / "t.rows", ROWS, DIM, 1, _fill)
    with pytest.raises(StoreError, match="no embedding store"):
        RowStore.open(tmp_path / "other.rows", ROWS, DIM, 1)


def test_interrupted_creation_leaves_no_file(tmp_path):
    def failing(block: torch.Tensor) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        RowStore.create(tmp_path / "t.rows", ROWS, DIM, 1, failing)
    assert list(tmp_path.iterdir()) == []


def test_acquire_maps_every_id_to_its_row(tmp_path):
    cache = _cache(tmp_path, 10)
    ids = torch.tensor([5, 3, 5, 9])
    pin = cache.acquire(ids)
    assert torch.equal(cache.weights[pin.slots], cache.store.weights()[ids])
    assert cache.stats.misses == 3 and cache.stats.hits == 0
    pin.release()
    cache.acquire(torch.tensor([3, 4])).release()
    assert cache.stats.hits == 1 and cache.stats.misses == 4


def test_dirty_rows_are_written_back_on_eviction_and_flush(tmp_path):
    cache = _cache(tmp_path, 4)
    pin = cache.acquire(torch.tensor([1, 2]))
    cache.weights[pin.unique_slots] += 100.0
    cache.state[pin.unique_slots] += 7.0
    cache.mark_dirty(pin.unique_slots)
    expected = cache.weights[pin.unique_slots].clone()
    pin.release()
    cache.acquire(torch.tensor([10, 11, 12, 13])).release()  # evicts rows 1 and 2
    assert cache.stats.evictions == 2 and cache.stats.writebacks == 2
    weights, state = cache.store.read(torch.tensor([1, 2]))
    assert torch.equal(weights, expected) and torch.equal(state, torch.full((2, 1), 7.0))
    pin = cache.acquire(torch.tensor([1]))  # reloaded from the store, with the update
    assert torch.equal(cache.weights[pin.slots], expected[:1])
    cache.weights[pin.slots] -= 1.0
    cache.mark_dirty(pin.unique_slots)
    cache.flush()
    assert torch.equal(cache.store.read(torch.tensor([1]))[0], expected[:1] - 1.0)


def test_pinned_rows_are_never_evicted(tmp_path):
    cache = _cache(tmp_path, 6)
    in_flight = cache.acquire(torch.tensor([0, 1, 2]))  # a batch between prefetch and backward
    slots = in_flight.slots.clone()
    for start in range(10, 40, 3):  # later batches churn through the other 3 slots
        cache.acquire(torch.arange(start, start + 3)).release()
    assert torch.equal(cache.slot_of_row[torch.tensor([0, 1, 2])].long(), slots)
    assert torch.equal(cache.row_of_slot[slots], torch.tensor([0, 1, 2]))
    assert cache.stats.evictions > 0


def test_too_small_cache_is_a_clear_error_and_changes_nothing(tmp_path):
    cache = _cache(tmp_path, 5)
    held = cache.acquire(torch.tensor([0, 1, 2]))
    pins_before = cache.pins.clone()
    with pytest.raises(CacheTooSmallError, match=r"has 5 rows; 3 are pinned .* needs 3 more .* at least 6"):
        cache.acquire(torch.tensor([2, 10, 11, 12]))
    assert torch.equal(cache.pins, pins_before)
    held.release()
    cache.acquire(torch.tensor([2, 10, 11, 12])).release()


def test_a_dropped_pin_releases_its_rows(tmp_path):
    cache = _cache(tmp_path, 3)
    pin = cache.acquire(torch.tensor([0, 1, 2]))
    assert cache.pinned_rows == 3 and not pin.released
    del pin
    gc.collect()
    assert cache.pinned_rows == 0
    cache.acquire(torch.tensor([3, 4, 5])).release()


@pytest.mark.parametrize(("policy", "evicted"), [("lru", 0), ("lfu", 1), ("tinylfu", 1), ("second-hit", 1)])
def test_eviction_policy_chooses_the_victim(tmp_path, policy, evicted):
    cache = _cache(tmp_path, 2, policy)
    cache.acquire(torch.tensor([0])).release()
    for _ in range(3):
        cache.acquire(torch.tensor([0])).release()  # row 0: used often, long ago
    cache.acquire(torch.tensor([1])).release()  # row 1: used once, just now
    cache.acquire(torch.tensor([2])).release()
    assert int(cache.slot_of_row[evicted]) == -1
    assert int(cache.slot_of_row[1 - evicted]) >= 0


@pytest.mark.parametrize(("policy", "kept"), [("lru", False), ("lfu", False), ("tinylfu", True)])
def test_tinylfu_remembers_a_frequent_row_across_its_eviction(tmp_path, policy, kept):
    cache = _cache(tmp_path, 2, policy)
    for _ in range(3):
        cache.acquire(torch.tensor([0])).release()
    cache.acquire(torch.tensor([1, 2])).release()  # needs both slots: row 0 is evicted
    cache.acquire(torch.tensor([0])).release()  # reloaded
    cache.acquire(torch.tensor([4])).release()
    cache.acquire(torch.tensor([5])).release()  # row 0 (4 requests) against row 4 (1, more recent)
    assert (int(cache.slot_of_row[0]) >= 0) == kept


@pytest.mark.parametrize(("policy", "kept"), [("lru", False), ("second-hit", True)])
def test_second_hit_keeps_a_row_requested_twice_against_rows_seen_once(tmp_path, policy, kept):
    cache = _cache(tmp_path, 3, policy)
    cache.acquire(torch.tensor([0])).release()
    cache.acquire(torch.tensor([0])).release()  # second request: admitted
    for row in range(10, 20):  # a scan of rows seen once
        cache.acquire(torch.tensor([row])).release()
    assert (int(cache.slot_of_row[0]) >= 0) == kept


def test_purge_refuses_while_rows_are_pinned(tmp_path):
    cache = _cache(tmp_path, 4)
    pin = cache.acquire(torch.tensor([0]))
    with pytest.raises(RuntimeError, match="in flight"):
        cache.purge()
    pin.release()
    cache.purge()
    assert int((cache.row_of_slot >= 0).sum()) == 0


def test_out_of_range_ids_are_refused(tmp_path):
    cache = _cache(tmp_path, 4)
    with pytest.raises(IndexError, match=r"\[0, 100\)"):
        cache.acquire(torch.tensor([3, ROWS]))


def test_options_validate(tmp_path):
    with pytest.raises(ValueError, match="exactly one"):
        TieredOptions(store_dir=tmp_path)
    with pytest.raises(ValueError, match="tinylfu"):
        TieredOptions(store_dir=tmp_path, cache_rows=4, policy="fifo")
    with pytest.raises(ValueError, match="does not exist"):
        TieredOptions(store_dir=tmp_path / "missing", cache_rows=4)
    assert TieredOptions(store_dir=tmp_path, cache_fraction=0.1).capacity(1000) == 100


def test_reads_on_several_threads_return_in_order_and_raise_after_all_ended():
    """`run_all` hands back each call's result in the calls' order, and an error only once every
    call has ended (none still reading behind it)."""
    import threading
    import time

    from tiered.readers import run_all

    names, ended = [], []

    def call(i):
        def run():
            names.append(threading.current_thread().name)
            time.sleep(0.01 * (4 - i))  # the first ends last
            ended.append(i)
            if i == 1:
                raise StoreError("short I/O")
            return i

        return run

    assert run_all([call(i) for i in (0, 2, 3)], 2) == [0, 2, 3]
    assert all(n.startswith("tiered-reader") for n in names), names
    ended.clear()
    with pytest.raises(StoreError, match="short I/O"):
        run_all([call(i) for i in range(4)], 2)
    assert sorted(ended) == [0, 1, 2, 3]
    names.clear()
    assert run_all([call(0), call(2)], 1) == [0, 2]
    assert names == [threading.current_thread().name] * 2


def _holding(lock):
    """A thread that holds `lock` until the returned event is set (then joins it: `stop()`)."""
    import threading

    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            held.set()
            release.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(10)

    def stop() -> None:
        release.set()
        holder.join()

    return stop


@pytest.mark.parametrize("reset", [True, False], ids=["reset", "twin-without-reset"])
def test_a_child_forked_while_a_read_pool_starts_reads_on_a_pool_of_its_own(reset):
    """The fork happens while another thread holds the lock that guards the read pool's start: the
    child inherits that lock held, by a thread it does not have. It reads on threads of its own at
    once. Twin: the child puts back what it inherited (as if the fork hook had not run), and waits
    on that lock forever: killed, None."""
    import threading

    from tiered import readers

    readers.run_all([lambda: 0, lambda: 1], 2)  # the parent's pool exists
    inherited = (readers._pool, readers._pid, readers._lock)
    stop = _holding(readers._lock)

    def child() -> int:
        if not reset:
            readers._pool, readers._pid, readers._lock = inherited
        names = []

        def read(i):
            return lambda: (names.append(threading.current_thread().name), i)[1]

        ok = readers.run_all([read(i) for i in range(4)], 2) == [0, 1, 2, 3]
        return 0 if ok and all(n.startswith("tiered-reader") for n in names) else 2

    status = _in_a_forked_child(child, timeout=20 if reset else 3)
    stop()
    if reset:
        assert status == 0, f"the forked child hung on the read pool's lock (None) or failed ({status})"
    else:
        assert status is None, f"without the reset the child did not hang on the held lock ({status})"


def _cache_child_checks(cache: RowCache, pin, *, mid_update: bool) -> int:
    """In a forked child: 0, or the number of the first check that failed. A pin taken in the
    parent is released at once; a cache inherited mid-update refuses `acquire` and `flush` with a
    clear error, one inherited between updates serves rows as in the parent."""
    if _returns_within(pin.release, 5.0) != ("returned", None) or not pin.released:
        return 1
    if not mid_update:
        outcome, got = _returns_within(lambda: cache.acquire(torch.tensor([3, 7])), 5.0)
        expected = cache.store.read(torch.tensor([3, 7]))[0]
        return 0 if outcome == "returned" and torch.equal(cache.weights[got.slots], expected) else 2
    for check, call in ((3, lambda: cache.acquire(torch.tensor([3]))), (4, cache.flush)):
        outcome, error = _returns_within(call, 5.0)
        if outcome != "raised" or "forked while another thread was updating" not in str(error):
            return check
    return 0


@pytest.mark.parametrize(
    "held, reset",
    [("_lock", True), ("_io_lock", True), (None, True), ("_lock", False), ("_io_lock", False)],
    ids=["lock", "io-lock", "none-held", "twin-lock-without-reset", "twin-io-lock-without-reset"],
)
def test_a_child_forked_while_a_cache_lock_is_held_never_waits_on_it(tmp_path, held, reset):
    """The fork happens while another thread holds one of a cache's locks (`_io_lock`: a prefetch
    reading on the worker thread; `_lock`: its bookkeeping, or backward's unpin). The child gets
    fresh locks: a pin released there returns, and the half-updated cache says so instead of
    serving rows. Twin: the child puts back the locks it inherited (as if the fork hook had not
    run) and waits forever on the first one it takes: killed, None."""
    cache = _cache(tmp_path, capacity=8)
    pin = cache.acquire(torch.tensor([1, 2]))
    inherited = (cache._lock, cache._io_lock)
    stop = _holding(getattr(cache, held)) if held else (lambda: None)

    def child() -> int:
        if reset:
            return _cache_child_checks(cache, pin, mid_update=held is not None)
        cache._lock, cache._io_lock, cache._forked_mid_update = *inherited, False
        pin.release()  # takes `_lock`
        cache.acquire(torch.tensor([3]))  # takes `_io_lock`, then `_lock`
        return 0

    status = _in_a_forked_child(child, timeout=20 if reset else 4)
    stop()
    pin.release()
    if reset:
        assert status == 0, f"the forked child hung (None) or failed check {status}"
        assert cache.acquire(torch.tensor([3])).slots.numel() == 1, "the parent's cache still works"
    else:
        assert status is None, f"without the reset the child did not hang on the held {held} ({status})"


def test_read_threads_default_to_this_ranks_share_of_the_cores(tmp_path, monkeypatch):
    import os

    from tiered import readers

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert readers.default_read_threads() == readers.MAX_THREADS  # one rank, not process-grouped
    monkeypatch.setattr(readers.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(readers.dist, "get_world_size", lambda: 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert readers.default_read_threads() == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert readers.default_read_threads() == 1
    with pytest.raises(ValueError, match="read_threads"):
        TieredOptions(store_dir=tmp_path, cache_rows=4, read_threads=0)
