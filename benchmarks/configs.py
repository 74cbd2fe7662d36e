"""The named models and batch shapes the benchmarks train: `BenchConfig` and the `CONFIGS` registry.

Every config but the `tiny*` ones (one linear layer: what a pipeline adds there is its host
overhead) is a DLRM (torchrec's `DLRMTrain`) on 13 dense features; they differ in where the time
goes. The `tiered*` configs keep every table on disk (the `tiered` kernel, a cold store, a few % of
the rows cached); the `sweep-*` ones are the sweep's 14 points, each with its link (`SWEEP_LINKS`);
`net-ids120` is the most network-bound, and it and the other `NETWORK_BOUND` configs have `-int32`
twins whose dataloader makes int32 ids and lengths (what narrowed ids send); the `gpu-*` ones are for
a GPU (scripts/gpu/README.md). Kept free of torch: the launcher and the reports read it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

__all__ = [
    "CONFIGS",
    "HEADS",
    "NETWORK_BOUND",
    "RUN_CONFIGS",
    "SWEEP_LINKS",
    "TIERED_CONFIGS",
    "BenchConfig",
    "get_config",
    "sweep_points",
    "table_bytes",
]

HEADS = ("dlrm", "linear", "linear-split", "linear-built", "linear-shared")


@dataclass(kw_only=True, slots=True, frozen=True)
class BenchConfig:
    """One model and batch shape."""

    name: str
    """Registry key, e.g. `input-dist-heavy`."""
    description: str
    """What sets it apart, in a few words (its shape is in its fields)."""
    batch_size: int
    """Samples per rank per step."""
    embedding_dim: int
    """Width of every table."""
    num_embeddings: int
    """Rows of each table."""
    ids_per_feature: int
    """Mean ids per feature per sample; lengths are uniform in [1, 2 * ids_per_feature - 1]."""
    dense_hidden: tuple[int, ...] = ()
    """Hidden widths of DLRM's bottom MLP (`embedding_dim` is appended)."""
    over_hidden: tuple[int, ...] = ()
    """Hidden widths of DLRM's top MLP (one logit is appended)."""
    num_tables: int = 26
    """Sparse features, one table each."""
    num_dense: int = 13
    """Dense features per sample (DLRM takes 13)."""
    head: str = "dlrm"
    """`dlrm`, or `linear`: one linear layer over the pooled embeddings and the dense features; or
    `linear` written the way users write models: `linear-split` (the batch's KJT split between two
    collections in forward), `linear-built` (a KJT built in forward from the batch's tensors) and
    `linear-shared` (one collection of half the tables called on both halves of the features)."""
    sharding_types: tuple[str, ...] = ("table_wise", "column_wise")
    """What the planner may choose on CPU (gloo has no row-wise); on CUDA it chooses freely."""
    cache_fraction: float | None = None
    """Tables on disk (`tiered` kernel, cold store) with this fraction of each shard's rows cached
    in RAM (on CUDA: torchrec's UVM-caching kernel, that fraction in HBM); None: tables in RAM."""
    id_skew: float | None = None
    """Ids from a power law with this exponent (hot rows spread over the table by a hash); None: uniform."""
    id_dtype: str = "int64"
    """What the dataloader makes: "int64" ids (and int32 lengths), or "int32" ids and lengths."""
    gpu_memory_gib: float | None = None
    """On CUDA, the most GPU memory the process may allocate through torch, in GiB
    (`torch.cuda.set_per_process_memory_fraction`): the run is then that of a GPU this size, which
    could not hold tables larger than it without a cache. The UVM-caching kernel's rows live in host
    memory, outside the cap; its HBM cache is inside. None: the whole GPU. Ignored on CPU."""

    def __post_init__(self) -> None:
        for field in ("batch_size", "embedding_dim", "num_embeddings", "ids_per_feature", "num_tables"):
            if getattr(self, field) < 1:
                raise ValueError(f"{self.name}: {field} must be positive, got {getattr(self, field)}")
        if self.id_dtype not in ("int64", "int32"):
            raise ValueError(f"{self.name}: id_dtype must be int64 or int32, got {self.id_dtype!r}")
        if self.head not in HEADS:
            raise ValueError(f"{self.name}: head must be one of {', '.join(HEADS)}, got {self.head!r}")
        if self.gpu_memory_gib is not None and self.gpu_memory_gib <= 0:
            raise ValueError(f"{self.name}: gpu_memory_gib must be positive, got {self.gpu_memory_gib}")


_SHAPE = ("batch_size", "ids_per_feature", "embedding_dim", "num_tables", "num_embeddings")
_SHAPE += ("dense_hidden", "over_hidden")


def _config(name: str, what: str, *shape: Any, **more: Any) -> BenchConfig:
    """`shape`: samples a rank, ids a feature, width, tables, rows a table, bottom MLP, top MLP."""
    return BenchConfig(name=name, description=what, **dict(zip(_SHAPE, shape, strict=True)), **more)


_TW = ("table_wise",)
_TINY = _config(
    "tiny", "nothing to hide", 64, 3, 8, 4, 1_000, (), (), num_dense=4, head="linear", sharding_types=_TW
)
_TIERED = _config(
    "tiered", "each step reads its misses", 256, 2, 32, 8, 10**6, (512, 256), (1024, 512), cache_fraction=0.05
)
_GPU_LARGE = _config("gpu-large", "for a GPU", 4096, 10, 128, 26, 500_000, (1024, 512), (1024, 1024, 512))
_LIST = [
    _config("demo", "the demo's DLRM", 128, 1, 16, 26, 10_000, (64,), (64,)),
    _config("input-dist-heavy", "the input all-to-all dominates", 256, 100, 4, 26, 10_000, (16,), (16,)),
    _config(
        "compute-heavy", "input_dist a small part", 256, 1, 64, 26, 10_000, (512, 256), (1024, 1024, 512)
    ),
    _TINY,
    replace(_TINY, name="tiny-split", head="linear-split", description="the batch's KJT split in two"),
    replace(_TINY, name="tiny-built", head="linear-built", description="a KJT built in forward"),
    replace(_TINY, name="tiny-shared", head="linear-shared", description="one collection called twice"),
    _TIERED,
    replace(_TIERED, name="tiered-skewed", cache_fraction=0.02, id_skew=1.05, description="power-law ids"),
    replace(
        _config(
            "tiered-balanced", "I/O ~ compute at 1 rank", 256, 1, 32, 8, 500_000, (1024, 1024), (2048, 1024)
        ),
        cache_fraction=0.05,
    ),
    _config("tiered-tiny", "for tests", 16, 2, 8, 2, 4_000, (16,), (16,), cache_fraction=0.25),
    _GPU_LARGE,
    replace(_GPU_LARGE, name="gpu-uvm", num_embeddings=2 * 10**6, num_tables=8, cache_fraction=0.05),
    # A GPU with work to hide (gpu-large's plain step was 5.6 ms on an H100, host-bound): 26M rows, 13.3 GB
    # in HBM. Its plain step cannot take under 23.5 ms on an H100 (the kernels of one stream add up): the
    # MLPs and the interaction are 1.45 TFLOP of fp32 a step (14.7M multiply-adds a sample forward,
    # backward twice that), 21.7 ms at 67 TFLOPS without tensor cores; the tables read 3.9M distinct rows
    # forward and read and write them again in the fused SGD, 6.0 GB, 1.8 ms at 3.35 TB/s.
    _config("gpu-busy", "20 ms a step or more", 16_384, 10, 128, 26, 10**6, (2048, 1024), (4096, 2048, 1024)),
    # 52M rows, 26.6 GB (24.8 GiB: more than the process may allocate) behind torchrec's UVM cache, 5 % of
    # them in HBM (1.3 GB). Ids are uniform: about 95 % of a step's 1.06M ids miss, and `prefetch()` brings
    # ~0.5 GB of rows from host memory a step.
    replace(_GPU_LARGE, name="gpu-uvm-big", num_embeddings=2 * 10**6, cache_fraction=0.05, gpu_memory_gib=16),
]
# The sweep: from network-bound (100 Mbit) to compute-bound (loopback). 100 Mbit points keep the
# bytes per step small. (name, link, samples, ids, dim, tables, bottom MLP, top MLP)
_POINTS = [
    ("100m-tiny", "100mbit", 128, 1, 16, 26, (64,), (64,)),
    ("100m-ids10", "100mbit", 256, 10, 8, 16, (32,), (32,)),
    ("100m-ids30", "100mbit", 128, 30, 4, 8, (16,), (16,)),
    ("100m-dense", "100mbit", 256, 5, 16, 12, (256, 128), (256, 128)),
    ("1g-tiny", "1gbit", 128, 1, 16, 26, (64,), (64,)),
    ("1g-ids100", "1gbit", 256, 100, 4, 26, (16,), (16,)),
    ("1g-ids100-dense", "1gbit", 256, 100, 4, 26, (128, 64), (128, 64)),
    ("1g-ids30", "1gbit", 512, 30, 16, 16, (128,), (128,)),
    ("1g-b1024", "1gbit", 1024, 10, 8, 8, (64,), (64,)),
    ("1g-dense", "1gbit", 512, 3, 32, 12, (512, 256), (512, 256)),
    ("lo-tiny", None, 128, 1, 16, 26, (64,), (64,)),
    ("lo-ids100", None, 256, 100, 4, 26, (16,), (16,)),
    ("lo-b1024", None, 1024, 10, 16, 8, (256,), (256,)),
    ("lo-dense", None, 256, 1, 64, 26, (512, 256), (1024, 1024, 512)),
]
SWEEP_LINKS: dict[str, str | None] = {f"sweep-{p[0]}": p[1] for p in _POINTS}
"""The sweep's configs in order, each with its link (a tc rate; None: loopback)."""
for _name, _link, *_shape in _POINTS:
    _LIST.append(_config(f"sweep-{_name}", f"over {_link or 'loopback'}", *_shape[:4], 10_000, *_shape[4:]))
_LIST += [
    _config("net-ids120", "ids: 98 % of the a2a", 1024, 120, 4, 16, 10_000, (16,), (16,), sharding_types=_TW),
    # Network-bound shapes nothing was tuned on: more tables with fewer ids; wider rows, more dense.
    _config("unseen-ids60", "network-bound, not tuned on", 768, 60, 8, 12, 20_000, (64, 32), (64,)),
    _config("unseen-wide", "network-bound, not tuned on", 512, 25, 32, 20, 50_000, (256, 128), (256, 128)),
    # First run once the verdict's second try was written: many small tables; a deeper dense part.
    _config("fresh-many", "not tuned on", 640, 15, 8, 40, 5_000, (32,), (32,)),
    _config("fresh-mid", "not tuned on", 384, 40, 16, 10, 30_000, (128, 64), (128, 64)),
    # Shaped before the threshold of 0.35 first ran, so nothing was tuned on it: a deeper bottom MLP.
    _config("fresh-deep", "not tuned on", 448, 30, 16, 16, 40_000, (256, 128, 64), (128, 64)),
    # Shaped before the threshold of 0.25 first ran: many narrow tables, a small batch; then, at 0.25
    # before their first run, long bags on few tables and a heavier dense part.
    _config("fresh-small", "not tuned on", 320, 35, 12, 24, 10_000, (64, 32), (64,)),
    _config("fresh-long", "not tuned on", 512, 80, 8, 8, 20_000, (128, 64), (64,)),
    _config("fresh-dense", "not tuned on", 256, 20, 16, 20, 10_000, (512, 256), (256, 128)),
]
NETWORK_BOUND = ("net-ids120", "input-dist-heavy", "sweep-1g-ids100-dense", "sweep-1g-ids30")
"""The configs where the input all-to-all dominates over 1 Gbit; each has an `-int32` twin."""
_LIST += [
    replace(c, name=f"{name.removeprefix('sweep-')}-int32", id_dtype="int32")
    for name in NETWORK_BOUND
    for c in _LIST
    if c.name == name
]
CONFIGS: dict[str, BenchConfig] = {c.name: c for c in _LIST}
RUN_CONFIGS = ("demo", "input-dist-heavy", "compute-heavy")
"""What `run` trains by default."""
TIERED_CONFIGS = ("tiered", "tiered-skewed", "tiered-balanced")
"""What `tiered` trains by default."""


def get_config(name: str) -> BenchConfig:
    """The config called `name` (a sweep point may drop its `sweep-` prefix).

    Raises:
        ValueError: no config has that name; the message lists them.
    """
    found = CONFIGS.get(name) or CONFIGS.get(f"sweep-{name}")
    if found is None:
        raise ValueError(f"unknown config {name!r}; choose from {', '.join(CONFIGS)}")
    return found


def sweep_points(points: list[str]) -> list[str]:
    """The configs of the sweep points named (all 14 if none), `sweep-` prefix or not.

    Raises:
        ValueError: a name is not a sweep point; the message lists them.
    """
    names = [get_config(p).name for p in points] if points else list(SWEEP_LINKS)
    unknown = [n for n in names if n not in SWEEP_LINKS]
    if unknown:
        raise ValueError(f"not sweep points: {', '.join(unknown)}; choose from {', '.join(SWEEP_LINKS)}")
    return names


def table_bytes(config: BenchConfig) -> int:
    """Bytes of every table's rows (fp32)."""
    return config.num_tables * config.num_embeddings * config.embedding_dim * 4
