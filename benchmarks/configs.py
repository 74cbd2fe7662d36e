"""The named models and batch shapes the benchmarks train: `BenchConfig` and the `CONFIGS` registry.

Every config but `tiny` is a DLRM (torchrec's `DLRMTrain`) on 13 dense features; they differ in where
the time goes. `demo` is the size of `make demo`; `input-dist-heavy` sends ~100 ids per feature per
sample with tiny MLPs, so the input all-to-all dominates; `compute-heavy` has one id per feature and
big MLPs. `tiny` (4 tables of 1,000 rows, one linear layer) leaves nothing to hide: what a pipeline
adds there is its host overhead. The `tiered*` configs keep every table on disk (the `tiered` kernel,
a cold store, a few % of the rows cached). The `sweep-*` configs are the sweep's 14 points, each with
its link (`SWEEP_LINKS`). `net-ids120` (16 table-wise tables, ~120 ids a feature, batch 1,024, a
small dense part) is the most network-bound; it and the other `NETWORK_BOUND` configs have `-int32`
twins whose dataloader makes int32 ids and lengths (what narrowed ids send). `gpu-busy` and
`gpu-uvm-big` are for one GPU: a plain step of 20 ms or more on an H100 (scripts/gpu/README.md has the
arithmetic), and 26.6 GB
of tables behind a UVM cache in a process held to 16 GiB of GPU memory. Kept free of torch: the
launcher and the reports read it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["CONFIGS", "HEADS", "NETWORK_BOUND", "RUN_CONFIGS", "SWEEP_LINKS", "TIERED_CONFIGS", "BenchConfig",
           "get_config", "sweep_points", "table_bytes"]  # fmt: skip

HEADS = ("dlrm", "linear", "linear-split", "linear-built", "linear-shared")


@dataclass(kw_only=True, slots=True, frozen=True)
class BenchConfig:
    """One model and batch shape."""

    name: str
    """Registry key, e.g. `input-dist-heavy`."""
    description: str
    """One line for the report: what dominates the step."""
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
    """Ids from a power law with this exponent (hot rows spread over the table by a hash); None:
    uniform."""
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


_DEMO = BenchConfig(name="demo", description="the demo's DLRM: 1 id per feature, dim 16, 64-wide MLPs",
                    batch_size=128, embedding_dim=16, num_embeddings=10_000, ids_per_feature=1,
                    dense_hidden=(64,), over_hidden=(64,))  # fmt: skip
_TIERED = BenchConfig(
    name="tiered",
    description="8 tables of 1M rows on disk, 5 % cached, cold store: each step reads its misses",
    batch_size=256, embedding_dim=32, num_embeddings=1_000_000, ids_per_feature=2, num_tables=8,
    dense_hidden=(512, 256), over_hidden=(1024, 512), cache_fraction=0.05,
)  # fmt: skip
_GPU_LARGE = BenchConfig(
    name="gpu-large",
    description="for a GPU: 26 tables of 500k rows, dim 128, 4096 samples of ~10 ids per feature",
    batch_size=4096, embedding_dim=128, num_embeddings=500_000, ids_per_feature=10,
    dense_hidden=(1024, 512), over_hidden=(1024, 1024, 512),
)  # fmt: skip
# Two configs a GPU user recognises, where the GPU has work to hide (gpu-large's plain step was 5.6 ms
# on an H100, host-bound). `gpu-busy`: 16,384 samples, 26 tables of 1M rows x 128 in HBM (26M rows,
# 13.3 GB: fbgemm's fused kernel), ~10 ids a feature, MLPs 2048-1024 / 4096-2048-1024. Its plain step
# cannot take under 23.5 ms on an H100 (the kernels of one stream add up): the MLPs
# and the interaction are 1.45 TFLOP of fp32 a step (14.7M multiply-adds a sample forward, backward
# twice that), 21.7 ms at the H100's 67 TFLOPS without tensor cores; the tables read 3.9M distinct
# rows forward and read and write them again in the fused SGD, 6.0 GB, 1.8 ms at 3.35 TB/s.
_GPU_BUSY = BenchConfig(
    name="gpu-busy",
    description="for a GPU: 16,384 samples of ~10 ids per feature, 26 tables of 1M rows x 128 in HBM, "
    "MLPs 2048-1024 / 4096-2048-1024: a step of 20 ms or more on an H100",
    batch_size=16_384,
    embedding_dim=128,
    num_embeddings=1_000_000,
    ids_per_feature=10,
    dense_hidden=(2048, 1024),
    over_hidden=(4096, 2048, 1024),
)
_TINY = BenchConfig(name="tiny", description="4 tables of 1,000 rows x 8, batch 64, one linear layer: "
                   "nothing to hide", batch_size=64, embedding_dim=8, num_embeddings=1_000,
                   ids_per_feature=3, num_tables=4, num_dense=4, head="linear",
                   sharding_types=("table_wise",))  # fmt: skip
_LIST = [
    _DEMO,
    replace(_DEMO, name="input-dist-heavy", batch_size=256, embedding_dim=4, ids_per_feature=100,
            dense_hidden=(16,), over_hidden=(16,),
            description="~100 ids per feature, dim 4, tiny MLPs: the input all-to-all dominates"),
    replace(_DEMO, name="compute-heavy", batch_size=256, embedding_dim=64, dense_hidden=(512, 256),
            over_hidden=(1024, 1024, 512),
            description="1 id per feature, dim 64, 1024-wide MLPs: input_dist is a small part"),
    _TINY,
    *(replace(_TINY, name=f"tiny-{p}", head=f"linear-{p}", description=f"tiny, its forward written "
              f"the {p} way: {how}") for p, how in (
        ("split", "the batch's KJT split between two collections"),
        ("built", "a KJT built from the batch's values and lengths"),
        ("shared", "one collection of 2 tables called on both halves of the features"))),
    _TIERED,
    replace(_TIERED, name="tiered-skewed", cache_fraction=0.02, id_skew=1.05,
            description="8 tables of 1M rows on disk, 2 % cached, power-law ids (exponent 1.05)"),
    replace(_TIERED, name="tiered-balanced", num_embeddings=500_000, ids_per_feature=1,
            dense_hidden=(1024, 1024), over_hidden=(2048, 1024),
            description="8 tables of 500k rows on disk, 5 % cached, 1 id: at 1 rank, I/O alone and "
            "compute alone within 30 % of each other"),
    replace(_TIERED, name="tiered-tiny", batch_size=16, embedding_dim=8, num_embeddings=4_000, num_tables=2,
            dense_hidden=(16,), over_hidden=(16,), cache_fraction=0.25,
            description="for tests: 2 tables of 4,000 rows on disk, 25 % cached, 16 samples"),
    _GPU_LARGE,
    replace(_GPU_LARGE, name="gpu-uvm", num_embeddings=2_000_000, num_tables=8, cache_fraction=0.05,
            description="for a GPU: 8 tables of 2M rows in host memory (UVM caching), 5 % in HBM"),
]  # fmt: skip
# `gpu-uvm-big`: gpu-large's shape on 26 tables of 2M rows (52M rows, 26.6 GB) in host memory behind
# torchrec's UVM cache, 5 % of the rows in HBM (1.3 GB), in a process that may allocate 16 GiB of GPU
# memory: the tables (24.8 GiB) could not be held there without the cache. Ids are uniform, so about
# 95 % of a step's 1.06M ids miss and `prefetch()` brings ~0.5 GB of rows from host memory a step.
_LIST += [
    _GPU_BUSY,
    replace(
        _GPU_LARGE,
        name="gpu-uvm-big",
        num_embeddings=2_000_000,
        cache_fraction=0.05,
        gpu_memory_gib=16,
        description="for a GPU: 26 tables of 2M rows x 128 (26.6 GB) in host memory behind a UVM cache "
        "of 5 % in HBM, the process held to 16 GiB of GPU memory",
    ),
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
for _name, _link, _batch, _ids, _dim, _tables, _bottom, _top in _POINTS:
    _LIST.append(
        BenchConfig(name=f"sweep-{_name}", batch_size=_batch, embedding_dim=_dim, num_embeddings=10_000,
                    ids_per_feature=_ids, num_tables=_tables, dense_hidden=_bottom, over_hidden=_top,
                    description=f"{_link or 'loopback'}: {_batch}/rank, {_ids} ids, dim {_dim}, "
                    f"{_tables} tables, MLPs {'-'.join(map(str, _bottom))} / {'-'.join(map(str, _top))}")
    )  # fmt: skip

_NET = BenchConfig(
    name="net-ids120", batch_size=1024, embedding_dim=4, num_embeddings=10_000, ids_per_feature=120,
    num_tables=16, dense_hidden=(16,), over_hidden=(16,), sharding_types=("table_wise",),
    description="16 table-wise tables, ~120 ids a feature, batch 1,024, tiny MLPs: the ids are ~98 % "
    "of the input all-to-all",
)  # fmt: skip
_LIST.append(_NET)
# Two network-bound shapes the default's constants were not chosen on (added to check its verdict
# where nothing was tuned): more tables with fewer ids, and wider rows with a larger dense part.
_LIST += [
    BenchConfig(
        name="unseen-ids60",
        description="12 tables, ~60 ids a feature, dim 8, batch 768, small MLPs",
        batch_size=768,
        embedding_dim=8,
        num_embeddings=20_000,
        ids_per_feature=60,
        num_tables=12,
        dense_hidden=(64, 32),
        over_hidden=(64,),
    ),
    BenchConfig(
        name="unseen-wide",
        description="20 tables, ~25 ids a feature, dim 32, batch 512, 256-wide MLPs",
        batch_size=512,
        embedding_dim=32,
        num_embeddings=50_000,
        ids_per_feature=25,
        num_tables=20,
        dense_hidden=(256, 128),
        over_hidden=(256, 128),
    ),
]
_BY_NAME = {c.name: c for c in _LIST}
NETWORK_BOUND = ("net-ids120", "input-dist-heavy", "sweep-1g-ids100-dense", "sweep-1g-ids30")
"""The configs where the input all-to-all dominates over 1 Gbit; each has an `-int32` twin."""
for _name in NETWORK_BOUND:
    _base = _BY_NAME[_name]
    _LIST.append(replace(_base, name=f"{_name.removeprefix('sweep-')}-int32", id_dtype="int32",
                         description=f"{_base.description}; int32 ids and lengths"))  # fmt: skip

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
