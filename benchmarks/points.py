"""The sweep's points: from network-bound to compute-bound, each a link rate and a `BenchConfig`.

The axes: the link (100 Mbit, 1 Gbit emulated; loopback), the dense MLPs (16-wide to 1024-wide), ids
per feature (1 to ~100), samples per rank (128 to 1024) and tables (8 to 26). Points are chosen so
that one sweep covers all of them on a 2-core machine in under 30 minutes: the 100 Mbit points keep
the bytes per step small (a 5 MiB input batch would take ~0.4 s a step there).

Kept free of torch imports (the launcher and report read it). To add a point, append a `SweepPoint`;
its config is then also known to `benchmarks.configs.get_config` (and so to the worker) by name.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.configs import BenchConfig

__all__ = ["POINTS", "SweepPoint", "get_point"]


@dataclass(kw_only=True, slots=True, frozen=True)
class SweepPoint:
    """One point of the sweep."""

    link: str | None
    """A `tc` rate for the emulated link (e.g. `1gbit`), or None for loopback."""
    config: BenchConfig
    """The model and batch shape; `config.name` is the point's name."""

    @property
    def name(self) -> str:
        return self.config.name


def _point(
    name: str,
    link: str | None,
    *,
    batch: int,
    ids: int,
    dim: int,
    tables: int,
    bottom: tuple[int, ...],
    top: tuple[int, ...],
) -> SweepPoint:
    config = BenchConfig(
        name=f"sweep-{name}",
        description=f"{link or 'loopback'}: {batch}/rank, {ids} ids, dim {dim}, {tables} tables, "
        f"MLPs {'-'.join(map(str, bottom))} / {'-'.join(map(str, top))}",
        batch_size=batch,
        embedding_dim=dim,
        num_embeddings=10_000,
        ids_per_feature=ids,
        dense_hidden=bottom,
        over_hidden=top,
        num_tables=tables,
    )
    return SweepPoint(link=link, config=config)


POINTS: tuple[SweepPoint, ...] = (
    # 100 Mbit: the link dominates unless the batch is tiny
    _point("100m-tiny", "100mbit", batch=128, ids=1, dim=16, tables=26, bottom=(64,), top=(64,)),
    _point("100m-ids10", "100mbit", batch=256, ids=10, dim=8, tables=16, bottom=(32,), top=(32,)),
    _point("100m-ids30", "100mbit", batch=128, ids=30, dim=4, tables=8, bottom=(16,), top=(16,)),
    _point("100m-dense", "100mbit", batch=256, ids=5, dim=16, tables=12, bottom=(256, 128), top=(256, 128)),
    # 1 Gbit
    _point("1g-tiny", "1gbit", batch=128, ids=1, dim=16, tables=26, bottom=(64,), top=(64,)),
    _point("1g-ids100", "1gbit", batch=256, ids=100, dim=4, tables=26, bottom=(16,), top=(16,)),
    _point("1g-ids100-dense", "1gbit", batch=256, ids=100, dim=4, tables=26, bottom=(128, 64), top=(128, 64)),
    _point("1g-ids30", "1gbit", batch=512, ids=30, dim=16, tables=16, bottom=(128,), top=(128,)),
    _point("1g-b1024", "1gbit", batch=1024, ids=10, dim=8, tables=8, bottom=(64,), top=(64,)),
    _point("1g-dense", "1gbit", batch=512, ids=3, dim=32, tables=12, bottom=(512, 256), top=(512, 256)),
    # loopback: memory copies on the same two cores; compute dominates
    _point("lo-tiny", None, batch=128, ids=1, dim=16, tables=26, bottom=(64,), top=(64,)),
    _point("lo-ids100", None, batch=256, ids=100, dim=4, tables=26, bottom=(16,), top=(16,)),
    _point("lo-b1024", None, batch=1024, ids=10, dim=16, tables=8, bottom=(256,), top=(256,)),
    _point("lo-dense", None, batch=256, ids=1, dim=64, tables=26, bottom=(512, 256), top=(1024, 1024, 512)),
)


def get_point(name: str) -> SweepPoint:
    """The point called `name` (with or without the `sweep-` prefix).

    Raises:
        ValueError: no such point; the message lists them.
    """
    for p in POINTS:
        if name in (p.name, p.name.removeprefix("sweep-")):
            return p
    raise ValueError(f"unknown point {name!r}; choose from {', '.join(p.name for p in POINTS)}")
