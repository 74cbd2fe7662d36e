"""Where the "auto" input_dist tuner starts from a prediction of each schedule's step (a prior the
caller passes, `Tuner(prior=...)`): the pure rule `start_from`, and what it concluded (`Start`).

The predicted best schedule runs from the first step. The schedules predicted within `noise` of it,
which the prediction cannot tell apart, are measured by the tuner's paired trials, and so is
torchrec's order ("late", `keep`), since the model's error exceeds the noise on some machines: a
wrong prediction costs a short trial, never a schedule slower than torchrec's. Where the model is
sure that torchrec's order is best, no trial runs at all.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Start", "predicted_steps", "start_from"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Start:
    """What a prediction lets the tuner skip."""

    best: str
    """The schedule predicted fastest: run first, and kept unless a trial shows better."""
    trials: tuple[str, ...]
    """The schedules to measure, `best` first; only `best` when the model is sure."""
    reason: str
    """In plain words, with the predicted figures."""


def start_from(
    predicted_ms: dict[str, float], candidates: tuple[str, ...], *, noise: float, keep: str | None = None
) -> Start | None:
    """The tuner's start from `predicted_ms` (a predicted step per schedule); None when the
    prediction misses a candidate or is not a finite positive figure (then every candidate is
    measured, as without a prediction)."""
    figures = {s: predicted_ms.get(s, math.nan) for s in candidates}
    if not all(math.isfinite(v) and v > 0 for v in figures.values()):
        return None
    best = min(candidates, key=figures.__getitem__)
    close = tuple(
        s
        for s in sorted(candidates, key=figures.__getitem__)
        if figures[s] <= figures[best] * (1 + noise) or s == keep
    )
    shown = ", ".join(f"{s} {figures[s]:.1f} ms" for s in sorted(candidates, key=figures.__getitem__))
    if len(close) == 1:
        runner_up = min((s for s in candidates if s != best), key=figures.__getitem__, default=None)
        margin = (
            f"; the next, {runner_up}, {figures[runner_up] / figures[best] - 1:.0%} slower"
            if runner_up
            else ""
        )
        reason = (
            f"{best}: predicted fastest by more than the noise ({noise:.0%}){margin}; no trials ({shown})"
        )
    elif (
        len(close) == 2 and keep in close and best != keep and figures[close[1]] > figures[best] * (1 + noise)
    ):
        reason = (
            f"{best}: predicted fastest by more than the noise ({noise:.0%}); measured against "
            f"{keep} (torchrec's order) to be sure ({shown})"
        )
    else:
        within = ", ".join(close)
        reason = f"predicted within the noise ({noise:.0%}) of each other: {within}; measured them ({shown})"
    return Start(best=best, trials=close, reason=reason)


def predicted_steps(
    prior: dict[str, float], candidates: list[str], agree: Callable[[list[float]], list[float]]
) -> dict[str, float]:
    """Each candidate's predicted step in `prior`, averaged over the ranks (`agree` sums), so that
    every rank plans alike; NaN where a rank's prior misses it (then every candidate is measured)."""
    *summed, ranks = agree([float(prior.get(s, math.nan)) for s in candidates] + [1.0])
    return {s: v / ranks for s, v in zip(candidates, summed, strict=True)}
