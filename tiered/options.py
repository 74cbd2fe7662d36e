"""What a user chooses for the tiered kernel: where the stores live and how big the caches are."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tiered.policy import POLICIES

__all__ = ["TieredOptions"]


@dataclass(kw_only=True, slots=True)
class TieredOptions:
    """Options of every table planned on the tiered kernel by one sharder."""

    store_dir: str | Path
    """Directory of the store files (one per table shard per rank); must exist and be writable."""
    cache_rows: int | None = None
    """RAM slots per table shard; at least the rows the batches in flight touch (2-3 batches)."""
    cache_fraction: float | None = None
    """Alternatively, slots as a fraction of each shard's rows (at least 1 slot)."""
    policy: str = "lru"
    """Eviction and admission policy (`tiered.policy`): "lru", "lfu", "tinylfu" (requests counted
    per row over a recent window, cached or not) or "second-hit" (a row admitted on its second
    request)."""
    store_mode: str = "create"
    """"create": new stores from the initial weights (replacing same-shaped ones); "open": keep the
    rows of existing stores (e.g. to resume), which must match the table shapes."""
    cold: bool = False
    """Drop rows from the OS page cache after reading them, so that every miss reads the disk
    (benchmarks of tables larger than RAM on a machine that has the RAM)."""
    read_threads: int | None = None
    """Threads that read a batch's table shards at once (`tiered.readers`); None: this rank's
    share of the cores (1 where the local ranks fill them)."""

    def __post_init__(self) -> None:
        if (self.cache_rows is None) == (self.cache_fraction is None):
            raise ValueError("give exactly one of cache_rows and cache_fraction")
        if self.cache_rows is not None and self.cache_rows < 1:
            raise ValueError(f"cache_rows must be positive; got {self.cache_rows}")
        if self.cache_fraction is not None and not 0 < self.cache_fraction <= 1:
            raise ValueError(f"cache_fraction must be in (0, 1]; got {self.cache_fraction}")
        if self.store_mode not in ("create", "open"):
            raise ValueError(f"store_mode must be 'create' or 'open'; got {self.store_mode!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {self.policy!r}")
        if self.read_threads is not None and self.read_threads < 1:
            raise ValueError(f"read_threads must be at least 1; got {self.read_threads}")
        directory = Path(self.store_dir)
        if not directory.is_dir():
            raise ValueError(f"embedding store directory {directory} does not exist; create it first")

    def capacity(self, rows: int) -> int:
        """Cache slots for a shard of `rows` rows."""
        if self.cache_rows is not None:
            return min(self.cache_rows, max(rows, 1))
        return max(1, int(rows * self.cache_fraction))
