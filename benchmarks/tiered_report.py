"""The tables-on-disk lines of a benchmark report: per config with tables on disk, the cache's figures
per variant, and Prefetch against its bound (`benchmarks.disk_bound`) and against the plain loop."""

from __future__ import annotations

from typing import Any

__all__ = ["BALANCED_CONFIG", "DISTANCE_LIMIT", "PLAIN_LIMIT", "distance", "tiered_lines"]

DISTANCE_LIMIT = 1.15
"""Tables on disk: Prefetch's step over max(I/O alone, compute alone), every config (issue 25)."""
BALANCED_CONFIG = "tiered-balanced"
PLAIN_LIMIT = 0.65
"""Tables on disk: Prefetch's step over the plain loop's on `BALANCED_CONFIG` at 1 rank (issue 25)."""


def tiered_lines(rows: list[Any], *, world_size: int) -> list[str]:
    """Per config with tables on disk: cache figures per variant, and Prefetch against its bound
    (`benchmarks.disk_bound`) and the plain loop; [] if no such config ran."""
    configs = list(dict.fromkeys(r.config for r in rows if r.cache_hit_rate is not None))
    lines = []
    for config in configs:
        by = {r.variant: r for r in rows if r.config == config and r.cache_hit_rate is not None}
        lines.append(f"{config} (tables on disk, cold store):")
        for variant, r in by.items():
            cpu = "" if r.cpu_ms is None else f", process CPU {r.cpu_ms:.1f} ms/step"
            lines.append(
                f"  {variant}: step {r.median_step_ms:.1f} ms, hit rate {r.cache_hit_rate:.3f}, store read "
                f"{r.store_read_ms:.1f} ms/step, making rows resident {r.prefetch_ms:.1f} ms/step{cpu}"
            )
        step = {v: r.median_step_ms for v, r in by.items()}
        pf, io, compute = step.get("ours-prefetch"), step.get("io-alone"), step.get("compute-alone")
        gap = distance(pf, io, compute)
        if gap is not None:
            lines.append(f"  bound: I/O alone {io:.1f} ms, compute alone {compute:.1f} ms")
            lines.append(
                f"  {_verdict(gap, DISTANCE_LIMIT)} Prefetch step / bound: {gap:.3f} (limit {DISTANCE_LIMIT})"
            )
        if pf and step.get("plain"):
            targeted = config == BALANCED_CONFIG and world_size == 1
            limit = f"limit {PLAIN_LIMIT} at 1 rank" if targeted else "no limit"
            verdict = _verdict(pf / step["plain"], PLAIN_LIMIT) if targeted else ""
            lines.append(f"  {verdict:6} Prefetch step / plain step: {pf / step['plain']:.3f} ({limit})")
    return lines


def distance(prefetch_ms: float | None, io_ms: float | None, compute_ms: float | None) -> float | None:
    """Prefetch's step over its bound, max(I/O alone, compute alone) (`benchmarks.disk_bound`); None
    if a figure is missing."""
    if prefetch_ms is None or io_ms is None or compute_ms is None:
        return None
    return prefetch_ms / max(io_ms, compute_ms)


def _verdict(measured: float, limit: float) -> str:
    return f"{'met' if measured <= limit else 'MISSED':6}"
