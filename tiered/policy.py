"""Eviction and admission policies: which unpinned cache slots give up their rows first.

A policy only scores slots; the cache decides which slots may be evicted (the unpinned ones) and
asks the policy for the lowest-scored among them. Empty slots always go first. Every row a batch
needs is loaded whatever the policy says (the batch reads it from its slot), so "admission" here
means how a newly loaded row ranks: a row that a policy does not admit is the first to go once its
batch is done with it, so a stream of rows seen once cannot push out the rows that are used often.

- `LRU`: least recently used first.
- `LFU`: fewest uses since the row was loaded first (recency breaks ties).
- `TinyLFU`: fewest requests in the recent history first, counted per row whether cached or not
  (TinyLFU's frequency history, with exact saturating counters per row instead of its sketch; all
  counters are halved every `10 x capacity` requests so that the history follows a changing
  stream), recency breaking ties. A row seen for the first time ranks below every row seen more
  often: it is admitted only once it is requested about as often as what it would displace.
- `SecondHit`: a row is admitted on its second request in a window (a doorkeeper bit per row,
  cleared every `10 x capacity` misses); until then it is on probation and evicted before any
  admitted row (LRU within each group).
"""

from __future__ import annotations

import torch

__all__ = ["LFU", "LRU", "POLICIES", "Policy", "SecondHit", "TinyLFU", "make_policy"]

_MAJOR = 2.0**40  # ranks a score's first key above its second (a clock below 2**40)
_WINDOW = 10  # requests (TinyLFU) or misses (SecondHit) per capacity before the history ages


class Policy:
    """Scores slots for eviction (lower goes first).

    `loaded(slots, rows)` is called for the slots that just received `rows` from the store, then
    `touch(slots, rows)` once per batch for every slot the batch uses (the just-loaded ones too).
    Both run under the cache's bookkeeping lock, so they must be quick (vectorized).
    """

    def __init__(self, capacity: int, rows: int) -> None:
        self._clock = 0
        self.last_used = torch.zeros(capacity, dtype=torch.int64)

    def touch(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        self._clock += 1
        self.last_used[slots] = self._clock

    def loaded(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        pass

    def scores(self) -> torch.Tensor:
        return self.last_used.double()


class LRU(Policy):
    """Least recently used goes first."""


class LFU(Policy):
    """Least frequently used (since the row was loaded) goes first; ties by recency."""

    def __init__(self, capacity: int, rows: int) -> None:
        super().__init__(capacity, rows)
        self.uses = torch.zeros(capacity, dtype=torch.int64)

    def touch(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        super().touch(slots, rows)
        self.uses[slots] += 1

    def loaded(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        self.uses[slots] = 0

    def scores(self) -> torch.Tensor:
        return self.uses.double() * _MAJOR + self.last_used.double()


class TinyLFU(Policy):
    """Fewest recent requests of the slot's row goes first, cached or not (module docstring)."""

    MAX_COUNT = 15
    """Counters saturate here (TinyLFU's 4-bit counters)."""

    def __init__(self, capacity: int, rows: int) -> None:
        super().__init__(capacity, rows)
        self.counts = torch.zeros(rows, dtype=torch.uint8)
        self.row_of_slot = torch.zeros(capacity, dtype=torch.int64)
        self._requests = 0
        self._window = _WINDOW * capacity

    def touch(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        super().touch(slots, rows)
        self.counts[rows] = (self.counts[rows] + 1).clamp_(max=self.MAX_COUNT)
        self._requests += len(rows)
        if self._requests >= self._window:
            self.counts.bitwise_right_shift_(1)
            self._requests //= 2

    def loaded(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        self.row_of_slot[slots] = rows

    def scores(self) -> torch.Tensor:
        return self.counts[self.row_of_slot].double() * _MAJOR + self.last_used.double()


class SecondHit(Policy):
    """A row is admitted on its second request; rows on probation go first (module docstring)."""

    def __init__(self, capacity: int, rows: int) -> None:
        super().__init__(capacity, rows)
        self.seen = torch.zeros(rows, dtype=torch.bool)
        self.probation = torch.zeros(capacity, dtype=torch.bool)
        self.loaded_at = torch.zeros(capacity, dtype=torch.int64)
        self._misses = 0
        self._window = _WINDOW * capacity

    def loaded(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        self._misses += len(rows)
        if self._misses >= self._window:
            self.seen.fill_(False)
            self._misses = 0
        self.probation[slots] = ~self.seen[rows]
        self.seen[rows] = True
        self.loaded_at[slots] = self._clock + 1  # the clock of this batch's touch

    def touch(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        super().touch(slots, rows)
        again = self.loaded_at[slots] < self._clock  # requested again after the batch that loaded it
        self.probation[slots[again]] = False

    def scores(self) -> torch.Tensor:
        return self.last_used.double() - self.probation.double() * _MAJOR


POLICIES: dict[str, type[Policy]] = {"lru": LRU, "lfu": LFU, "tinylfu": TinyLFU, "second-hit": SecondHit}
"""Policy classes by the name `TieredOptions.policy` takes."""


def make_policy(name: str, capacity: int, rows: int) -> Policy:
    """The policy called `name` (a key of `POLICIES`) over `capacity` slots of a shard of `rows` rows.

    Raises:
        ValueError: unknown name.
    """
    if name not in POLICIES:
        raise ValueError(f"eviction policy must be one of {sorted(POLICIES)}; got {name!r}")
    return POLICIES[name](capacity, rows)
