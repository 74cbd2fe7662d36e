"""The named model/batch shapes the benchmark runs: `BenchConfig` and the `CONFIGS` registry.

Every config is a DLRM (torchrec's `DLRMTrain`) on 26 sparse and 13 dense features; they differ in
where the time goes. `demo` is the size of `make demo`; `input-dist-heavy` sends ~100 ids per feature
per sample with a tiny embedding dim and tiny MLPs, so the input all-to-all dominates; `compute-heavy`
has one id per feature, a wide embedding and big MLPs, so input_dist is a small part of the step (over
loopback dense compute dominates it; over a 1 Gbit link the all-reduce of the 2.2 M dense gradients and
the pooled-embedding all-to-alls do). `tiered` puts every table on disk (the `tiered` kernel, cold
store, 5 % of the rows cached), so each step reads thousands of rows from the disk: the work the
Prefetch pipeline hides behind the previous batch's backward.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from examples.dlrm.config import NUM_DENSE, NUM_SPARSE  # the DLRM example's Criteo-like inputs

__all__ = ["CONFIGS", "GPU_CONFIGS", "NUM_DENSE", "NUM_SPARSE", "SMALL_CONFIGS", "BenchConfig", "get_config"]


@dataclass(kw_only=True, slots=True, frozen=True)
class BenchConfig:
    """One model and batch shape."""

    name: str
    """Registry key, e.g. `input-dist-heavy`."""
    description: str
    """One line for the report: what dominates the step."""
    batch_size: int
    """Samples per rank per step (the global batch is this times the world size)."""
    embedding_dim: int
    """Width of every table (DLRM needs one width for all)."""
    num_embeddings: int
    """Rows of each of the 26 tables."""
    ids_per_feature: int
    """Mean ids per sparse feature per sample; lengths are uniform in [1, 2 * ids_per_feature - 1]
    (exactly 1 when this is 1)."""
    dense_hidden: tuple[int, ...]
    """Hidden widths of the bottom MLP; `embedding_dim` is appended as its output."""
    over_hidden: tuple[int, ...]
    """Hidden widths of the top MLP; a single logit is appended as its output."""
    cache_fraction: float | None = None
    """Tables on the disk-backed `tiered` kernel with this fraction of each shard's rows cached in
    RAM, the store cold (every miss reads the disk); None keeps them in RAM (torchrec's fused kernel)."""
    num_tables: int = NUM_SPARSE
    """Sparse features, one table each (the DLRM example's 26 by default)."""
    id_skew: float | None = None
    """Ids drawn from a power law with this exponent (the id of popularity rank r has probability
    ~ 1 / (r + 1) ** id_skew; rank to row by a fixed bijective hash, so hot rows are spread over
    the table), as in real click logs; None: uniform."""

    def __post_init__(self) -> None:
        for field in ("batch_size", "embedding_dim", "num_embeddings", "ids_per_feature", "num_tables"):
            if getattr(self, field) < 1:
                raise ValueError(f"{self.name}: {field} must be positive, got {getattr(self, field)}")


CONFIGS: dict[str, BenchConfig] = {
    c.name: c
    for c in (
        BenchConfig(
            name="demo",
            description="the demo's DLRM: 1 id per feature, dim 16, 64-wide MLPs",
            batch_size=128,
            embedding_dim=16,
            num_embeddings=10_000,
            ids_per_feature=1,
            dense_hidden=(64,),
            over_hidden=(64,),
        ),
        BenchConfig(
            name="input-dist-heavy",
            description="~100 ids per feature, dim 4, tiny MLPs: the input all-to-all dominates",
            batch_size=256,
            embedding_dim=4,
            num_embeddings=10_000,
            ids_per_feature=100,
            dense_hidden=(16,),
            over_hidden=(16,),
        ),
        BenchConfig(
            name="compute-heavy",
            description="1 id per feature, dim 64, 1024-wide MLPs: input_dist is a small part of the step",
            batch_size=256,
            embedding_dim=64,
            num_embeddings=10_000,
            ids_per_feature=1,
            dense_hidden=(512, 256),
            over_hidden=(1024, 1024, 512),
        ),
        BenchConfig(
            name="tiered",
            description="8 tables of 1M rows on disk (1 GB), 5 % cached, cold store: each step reads "
            "its misses from the disk",
            batch_size=256,
            embedding_dim=32,
            num_embeddings=1_000_000,
            ids_per_feature=2,
            num_tables=8,
            dense_hidden=(512, 256),
            over_hidden=(1024, 512),
            cache_fraction=0.05,
        ),
    )
}
CONFIGS["tiered-skewed"] = replace(
    CONFIGS["tiered"],
    name="tiered-skewed",
    description="8 tables of 1M rows on disk, 2 % cached, cold store, power-law ids (exponent 1.05, "
    "like a click log's): fewer misses, each still read from the disk",
    cache_fraction=0.02,
    id_skew=1.05,
)
CONFIGS["tiered-balanced"] = replace(
    CONFIGS["tiered"],
    name="tiered-balanced",
    description="8 tables of 500k rows on disk, 5 % cached, cold store, 1 id per feature, MLPs "
    "1024-1024 / 2048-1024: at 1 rank, I/O alone and compute alone within 30 % of each other",
    num_embeddings=500_000,
    ids_per_feature=1,
    dense_hidden=(1024, 1024),
    over_hidden=(2048, 1024),
)

SMALL_CONFIGS: dict[str, BenchConfig] = {
    "tiered-tiny": replace(
        CONFIGS["tiered"],
        name="tiered-tiny",
        description="for tests: 2 tables of 4,000 rows on disk, 25 % cached, 16 samples",
        batch_size=16,
        embedding_dim=8,
        num_embeddings=4_000,
        num_tables=2,
        dense_hidden=(16,),
        over_hidden=(16,),
        cache_fraction=0.25,
    ),
}
"""Configs for the benchmark's own tests; not in `CONFIGS`, so `make bench` skips them."""


GPU_CONFIGS: dict[str, BenchConfig] = {
    "gpu-large": BenchConfig(
        name="gpu-large",
        description="for a GPU (too big for the CPU runs): 26 tables of 500k rows, dim 128, 4096 "
        "samples of ~10 ids per feature, 1024-wide MLPs",
        batch_size=4096,
        embedding_dim=128,
        num_embeddings=500_000,
        ids_per_feature=10,
        dense_hidden=(1024, 512),
        over_hidden=(1024, 1024, 512),
    ),
}
GPU_CONFIGS["gpu-uvm"] = replace(
    GPU_CONFIGS["gpu-large"],
    name="gpu-uvm",
    description="for a GPU: 8 tables of 2M rows in host memory (torchrec's UVM-caching kernel), 5 % "
    "cached in HBM, 4096 samples of ~10 ids per feature: prefetch() fills the cache",
    num_embeddings=2_000_000,
    num_tables=8,
    cache_fraction=0.05,
)
"""Configs sized for a GPU (docs/gpu.md); not in `CONFIGS`, so `make bench` on a CPU skips them."""


def get_config(name: str) -> BenchConfig:
    """The config called `name`: one of `CONFIGS` or `GPU_CONFIGS`, or a sweep point's
    (`benchmarks.points`).

    Raises:
        ValueError: no config has that name; the message lists the named ones.
    """
    from benchmarks.points import POINTS  # the sweep's configs are built from BenchConfig

    known = {**CONFIGS, **SMALL_CONFIGS, **GPU_CONFIGS, **{p.config.name: p.config for p in POINTS}}
    try:
        return known[name]
    except KeyError:
        raise ValueError(f"unknown config {name!r}; choose from {', '.join(CONFIGS)}") from None
