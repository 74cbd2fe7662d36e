"""A disk-backed embedding kernel for torchrec on CPU: rows and optimizer state live in a file per
table shard (`tiered.store`), a bounded number of rows live in RAM slots (`tiered.cache`), and
`prefetch()` fills those slots ahead of forward, so the Prefetch pipeline hides the disk reads behind
the previous batch's backward. Tables can be far larger than RAM.

Neither `pipeline` nor `rewrite` imports this package: the pipeline only calls `prefetch()`.

    sharder = TieredEmbeddingBagCollectionSharder(TieredOptions(store_dir="/data/emb", cache_rows=100_000))
    per_table = {"t0": table_wise(rank=0, compute_kernel=TIERED)}
    plan = construct_module_sharding_plan(ebc, per_param_sharding=per_table, sharder=sharder)
"""

from tiered.cache import CacheStats, CacheTooSmallError, Pin, RowCache
from tiered.kernel import TieredEmbeddingBag
from tiered.options import TieredOptions
from tiered.policy import LFU, LRU, POLICIES, SecondHit, TinyLFU, make_policy
from tiered.sharder import (
    TIERED,
    TieredEmbeddingBagCollectionSharder,
    TieredLookup,
    TieredShardedEmbeddingBagCollection,
)
from tiered.store import RowStore, StoreError, StoreStats

__all__ = [
    "LFU",
    "LRU",
    "POLICIES",
    "TIERED",
    "CacheStats",
    "CacheTooSmallError",
    "Pin",
    "RowCache",
    "RowStore",
    "SecondHit",
    "StoreError",
    "StoreStats",
    "TieredEmbeddingBag",
    "TieredEmbeddingBagCollectionSharder",
    "TieredLookup",
    "TieredOptions",
    "TieredShardedEmbeddingBagCollection",
    "TinyLFU",
    "make_policy",
]
