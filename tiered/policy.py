"""Eviction policies: which unpinned cache slots give up their rows first.

A policy only scores slots; the cache decides which slots may be evicted (the unpinned ones) and
asks the policy for the lowest-scored among them. Empty slots always go first.
"""

from __future__ import annotations

import torch

__all__ = ["LFU", "LRU", "Policy", "make_policy"]


class Policy:
    """Scores slots for eviction (lower goes first). `touch` is called for every slot a batch
    uses, `loaded` for every slot that just received a row from the store."""

    def __init__(self, capacity: int) -> None:
        self._clock = 0
        self.last_used = torch.zeros(capacity, dtype=torch.int64)

    def touch(self, slots: torch.Tensor) -> None:
        self._clock += 1
        self.last_used[slots] = self._clock

    def loaded(self, slots: torch.Tensor) -> None:
        pass

    def scores(self) -> torch.Tensor:
        return self.last_used.double()


class LRU(Policy):
    """Least recently used goes first."""


class LFU(Policy):
    """Least frequently used (since the row was loaded) goes first; ties by recency."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.uses = torch.zeros(capacity, dtype=torch.int64)

    def touch(self, slots: torch.Tensor) -> None:
        super().touch(slots)
        self.uses[slots] += 1

    def loaded(self, slots: torch.Tensor) -> None:
        self.uses[slots] = 0

    def scores(self) -> torch.Tensor:
        return self.uses.double() * 2.0**40 + self.last_used.double()


def make_policy(name: str, capacity: int) -> Policy:
    """`"lru"` or `"lfu"`."""
    policies = {"lru": LRU, "lfu": LFU}
    if name not in policies:
        raise ValueError(f"eviction policy must be one of {sorted(policies)}; got {name!r}")
    return policies[name](capacity)
