"""Paired comparisons over interleaved rounds: the one way every suite here compares two variants.

In each round every variant runs once, in an order rotated from round to round, so a round's A/B
ratio (or A-B difference) compares two runs made minutes apart on the same machine state; slow drift
cancels. A comparison is reported as the median over rounds with the lowest and highest round.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Paired", "paired", "paired_difference", "round_medians"]


@dataclass(kw_only=True, slots=True)
class Paired:
    """A ratio (or difference) over paired rounds."""

    median: float
    low: float
    high: float
    rounds: int

    def __format__(self, spec: str) -> str:
        """`f"{p:+}"`: the median and the range, each formatted with `spec` and 3 decimals."""
        f = f"{spec}.3f"
        return f"{self.median:{f}} [{self.low:{f}}, {self.high:{f}}]"


def round_medians(runs: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Per round, each variant's median step time in ms, from run records with `round`, `variant`,
    `status` and `step_times_s` (runs that went wrong are left out)."""
    out: dict[int, dict[str, float]] = {}
    for r in runs:
        if r["status"] == "ok":
            out.setdefault(r["round"], {})[r["variant"]] = statistics.median(r["step_times_s"]) * 1e3
    return out


def _over(values: list[float]) -> Paired | None:
    if not values:
        return None
    return Paired(median=statistics.median(values), low=min(values), high=max(values), rounds=len(values))


def paired(rounds: Mapping[Any, Mapping[str, float]], a: str, b: str) -> Paired | None:
    """A/B from every round that ran both; None if none did."""
    return _over([r[a] / r[b] for r in rounds.values() if a in r and b in r and r[b] > 0])


def paired_difference(rounds: Mapping[Any, Mapping[str, float]], a: str, b: str) -> Paired | None:
    """A-B from every round that ran both; None if none did."""
    return _over([r[a] - r[b] for r in rounds.values() if a in r and b in r])
