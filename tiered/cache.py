"""The fast tier: a bounded number of rows of one table shard in RAM slots, filled from a store.

The cache knows slots, pins and eviction, and nothing of torchrec. `acquire(ids)` (the prefetch)
makes every row of a batch resident and pins it; the returned `Pin` carries the slot of every id and
is released after that batch's update (or when dropped). Only unpinned rows are evicted, so the
prefetch of batch i+1 can run while batch i is still in backward: the rows batch i reads and updates
stay where they are. Dirty rows are written back to the store on eviction (queued: the store writes
them behind, and a read sees them at once) and on `flush()` (which waits until they are in the file).

Thread safety: one prefetch (or flush) at a time (`_io_lock`); the bookkeeping (`_lock`) is held
only briefly, never across disk I/O, so a pin released by backward on the main thread never waits
for a prefetch that is reading from disk on a worker thread.

A forked child (a dataloader worker forked while a prefetch reads on the worker thread) gets both
locks fresh: a lock another thread held at the fork would stay held in the child, by a thread it
does not have, and a pin released there (or dropped: its finalizer) would wait on it forever. A
cache inherited while a lock was held may be half-updated (slots assigned, rows not yet read), so
the child refuses `acquire`/`flush` with `RuntimeError`; releasing pins and `purge()` still work.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from tiered.policy import Policy
from tiered.store import RowStore

__all__ = ["CacheStats", "CacheTooSmallError", "Pin", "RowCache", "rows_needed"]

_CACHES: weakref.WeakSet[RowCache] = weakref.WeakSet()
"""Every cache of this process (a forked child gives each fresh locks: `_after_fork_in_child`)."""


class CacheTooSmallError(RuntimeError):
    """The rows a batch needs do not fit beside the rows pinned by the batches in flight.

    `distinct_rows` is how many distinct rows of the shard this batch asked for.
    """

    def __init__(self, message: str, *, distinct_rows: int = 0) -> None:
        super().__init__(message)
        self.distinct_rows = distinct_rows


def rows_needed(*, distinct_rows_per_batch: int, batches_in_flight: int, shard_rows: int) -> int:
    """The cache size that never raises CacheTooSmallError for one table shard.

    Each batch pins its distinct rows from its prefetch until its update, so at most
    `batches_in_flight` batches' rows are pinned at once, and never more rows than the shard has.

    Args:
        distinct_rows_per_batch: the most distinct rows of this shard one batch can ask for.
        batches_in_flight: the most batches holding pins at once (1 for a plain loop, where forward
            prefetches inline; more when a pipeline prefetches ahead).
        shard_rows: rows of the table shard.
    """
    return min(shard_rows, distinct_rows_per_batch * batches_in_flight)


@dataclass(slots=True)
class CacheStats:
    """Cumulative counts of one cache (per unique row per batch)."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    writebacks: int = 0
    prefetch_seconds: float = 0.0
    prefetches: int = 0


class Pin:
    """The rows of one batch, resident and pinned: `slots[i]` is the cache slot of `ids[i]`.

    `release()` unpins them (idempotent); a Pin that is garbage-collected unreleased releases
    itself, so an abandoned batch never keeps rows pinned.
    """

    def __init__(self, cache: RowCache, unique_slots: torch.Tensor, slots: torch.Tensor) -> None:
        self.slots = slots
        self.unique_slots = unique_slots
        self._release = weakref.finalize(self, cache._unpin, unique_slots)

    def release(self) -> None:
        self._release()

    @property
    def released(self) -> bool:
        return not self._release.alive


class RowCache:
    """`capacity` RAM slots holding rows (weights and optimizer state) of `store`.

    Args:
        store: where rows live.
        capacity: number of slots.
        policy: eviction policy over the slots.
        name: for error messages.
    """

    def __init__(self, store: RowStore, capacity: int, policy: Policy, *, name: str = "") -> None:
        if capacity < 1:
            raise ValueError(f"cache of {name or 'a table'} needs at least one slot; got {capacity}")
        self.store, self.capacity, self.policy, self.name = store, capacity, policy, name
        self.weights = torch.zeros(capacity, store.dim)
        self.state = torch.zeros(capacity, store.state_width)
        self.slot_of_row = torch.full((store.rows,), -1, dtype=torch.int32)
        self.row_of_slot = torch.full((capacity,), -1, dtype=torch.int64)
        self.pins = torch.zeros(capacity, dtype=torch.int32)
        self.dirty = torch.zeros(capacity, dtype=torch.bool)
        self.stats = CacheStats()
        self._lock = threading.Lock()
        self._io_lock = threading.Lock()
        self._forked_mid_update = False
        """In a forked child: a lock was held at the fork (the bookkeeping may be half-updated)."""
        _CACHES.add(self)

    def acquire(self, ids: torch.Tensor) -> Pin:
        """Make the rows `ids` resident and pin them until the returned Pin is released.

        Raises:
            CacheTooSmallError: the cache cannot hold these rows beside the pinned ones.
            IndexError: an id is outside the shard's rows.
        """
        started = time.perf_counter()
        ids = ids.long()
        if self._forked_mid_update:
            self._refuse("acquire rows")
        with self._io_lock:
            unique = torch.unique(ids)
            if len(unique) and (unique[0] < 0 or unique[-1] >= self.store.rows):
                raise IndexError(
                    f"{self.name}: ids must be in [0, {self.store.rows}); got {unique[0]}..{unique[-1]}"
                )
            with self._lock:
                chosen, missing, evicted = self._assign(unique)
            self._write_back(*evicted)
            if len(missing):
                weights, state = self.store.read(missing)
                self.weights[chosen] = weights
                self.state[chosen] = state
            with self._lock:
                unique_slots = self.slot_of_row[unique].long()
                slots = self.slot_of_row[ids].long()
                self.policy.touch(unique_slots, unique)
            self.stats.hits += len(unique) - len(missing)
            self.stats.misses += len(missing)
            self.stats.prefetches += 1
        self.stats.prefetch_seconds += time.perf_counter() - started
        return Pin(self, unique_slots, slots)

    def _assign(self, unique: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """Pin the resident rows of `unique`, pick and pin slots for the others (evicting
        unpinned rows). Returns (slots for the missing rows, the missing rows, (dirty evicted
        rows, their slots)). Called under `_lock`."""
        slots = self.slot_of_row[unique].long()
        resident = slots >= 0
        self.pins[slots[resident]] += 1
        missing = unique[~resident]
        need = len(missing)
        unpinned = self.pins.numpy() == 0 if need else None  # all hits: nothing over all slots
        if need and int(unpinned.sum()) < need:
            self.pins[slots[resident]] -= 1
            pinned_rows = int((self.pins > 0).sum())
            raise CacheTooSmallError(
                f"cache of {self.name or 'a table'} has {self.capacity} rows; {pinned_rows} are pinned by "
                f"batches in flight, and this batch needs {need} more ({len(unique)} distinct rows): "
                f"at least {pinned_rows + need} rows now, and `rows_needed()` (the most distinct rows "
                "a batch can have times the batches in flight) for every batch (cache_rows).",
                distinct_rows=len(unique),
            )
        chosen = self._victims(unpinned, need)
        old_rows = self.row_of_slot[chosen]
        occupied = old_rows >= 0
        dirty = occupied & self.dirty[chosen]
        evicted = (old_rows[dirty], chosen[dirty])
        self.slot_of_row[old_rows[occupied]] = -1
        self.slot_of_row[missing] = chosen.int()
        self.row_of_slot[chosen] = missing
        self.pins[chosen] += 1
        self.dirty[chosen] = False
        self.policy.loaded(chosen, missing)
        self.stats.evictions += int(occupied.sum())
        return chosen, missing, evicted

    def _victims(self, unpinned: np.ndarray | None, need: int) -> torch.Tensor:
        """The `need` unpinned slots to (re)fill: empty ones first, then the policy's lowest.

        One pass over the slots in numpy (no gather of the unpinned ones, a partition instead of a
        sort): this runs once per table per batch, under the lock that backward's unpin takes."""
        if need == 0:
            return torch.zeros(0, dtype=torch.int64)
        scores = np.where(unpinned, self.policy.scores().numpy(), np.inf)
        scores[self.row_of_slot.numpy() < 0] = -np.inf  # an empty slot is never pinned
        if need == len(scores):
            return torch.arange(need)
        return torch.from_numpy(np.argpartition(scores, need - 1)[:need])

    def _write_back(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        if len(rows):
            order = torch.argsort(rows)
            rows, slots = rows[order], slots[order]
            self.store.write(rows, self.weights[slots], self.state[slots], owned=True)  # fresh gathers
            self.stats.writebacks += len(rows)

    def _unpin(self, unique_slots: torch.Tensor) -> None:
        with self._lock:
            self.pins[unique_slots] -= 1

    def mark_dirty(self, slots: torch.Tensor) -> None:
        """`slots` were updated in place (their rows must be written back before eviction)."""
        with self._lock:
            self.dirty[slots] = True

    def flush(self) -> None:
        """Write every dirty row back to the store and wait until it is in the file (rows stay
        cached)."""
        if self._forked_mid_update:
            self._refuse("flush")
        with self._io_lock:
            with self._lock:
                slots = torch.nonzero(self.dirty).squeeze(1)
                rows = self.row_of_slot[slots]
                self.dirty[slots] = False
            self._write_back(rows, slots)
            self.store.sync()

    def purge(self) -> None:
        """Forget every cached row without writing it back (after the store was overwritten).

        Raises:
            RuntimeError: rows are pinned by batches in flight.
        """
        with self._io_lock, self._lock:
            if bool((self.pins > 0).any()):
                raise RuntimeError(
                    f"{self.name}: cannot drop the cache while batches are in flight; finish or "
                    "detach the pipeline before loading a checkpoint"
                )
            resident = self.row_of_slot >= 0
            self.slot_of_row[self.row_of_slot[resident]] = -1
            self.row_of_slot.fill_(-1)
            self.dirty.fill_(False)

    def _refuse(self, what: str) -> None:
        raise RuntimeError(
            f"{self.name or 'a cache'}: this process was forked while another thread was updating the "
            f"cache, which may be half-updated here: cannot {what}. Fork before training starts or "
            "while no prefetch runs, or build the model again in the child"
        )

    def _after_fork_in_child(self) -> None:
        """In a forked child: fresh locks (a parent's thread may have held one at the fork)."""
        self._forked_mid_update = self._lock.locked() or self._io_lock.locked()
        self._lock, self._io_lock = threading.Lock(), threading.Lock()

    @property
    def pinned_rows(self) -> int:
        return int((self.pins > 0).sum())

    @property
    def full(self) -> bool:
        """Every slot holds a row (or every row of the shard is resident): from here on a batch's
        misses evict, and a prefetch costs what it will cost in the steady state."""
        if self.stats.evictions > 0:
            return True
        return int((self.row_of_slot >= 0).sum()) >= min(self.capacity, self.store.rows)


def _after_fork_in_child() -> None:
    for cache in list(_CACHES):
        cache._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
