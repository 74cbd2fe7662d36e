"""`--compare plain`: after a pipelined run, train the plain loop on the same config and say how the
pipeline compared.

Both runs report the same measure, the summary's `step_time_ms`: wall time from the end of
`--warmup-steps` to the end of the run, eval passes left out, divided by the timed steps, the slowest
rank's. The plain run comes second, in the same processes, with eval, profiling and the progress bar
off. One run of each on a shared machine moves by 10-45 % from round to round, so the verdict says
which way and by how much, not that the difference is significant; docs/benchmarks.md measures
with interleaved rounds.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from examples.dlrm.config import InputError, TrainConfig

__all__ = ["check_comparable", "comparison", "plain_config", "verdict"]


def check_comparable(config: TrainConfig) -> None:
    """Check, before any collective, that `--compare plain` can run after this config.

    Raises:
        InputError: the run is already the plain loop, or its tables are on disk (a second run
            would train the same store again).
    """
    if config.pipeline == "none":
        raise InputError(
            "--compare plain compares a pipeline with the plain loop; pick --pipeline", every_rank=True
        )
    if config.embedding_store is not None:
        raise InputError(
            "--compare plain with --embedding-store would train the same store twice; run "
            "--pipeline none separately on a store of its own",
            every_rank=True,
        )


def plain_config(config: TrainConfig) -> TrainConfig:
    """`config` as the plain loop, with nothing but training in it."""
    return replace(config, pipeline="none", eval_every=0, profile_dir=None, show_progress=False)


def comparison(pipelined: dict[str, Any], plain: dict[str, Any]) -> dict[str, Any]:
    """The summary keys that compare the two runs: `plain_step_time_ms` and `vs_plain` (the
    pipeline's step time over the plain loop's; below 1 is faster), and `plain_first_step_ms` (the
    plain loop's first step, beside the pipeline's `first_step_ms`)."""
    mine, base = pipelined.get("step_time_ms"), plain.get("step_time_ms")
    first = {"plain_first_step_ms": plain.get("first_step_ms")}
    if not mine or not base:
        return {"plain_step_time_ms": base, "vs_plain": None, **first}
    return {"plain_step_time_ms": base, "vs_plain": round(mine / base, 3), **first}


def verdict(summary: dict[str, Any]) -> str | None:
    """One line: faster or slower than the plain loop, by how much; None without a comparison."""
    ratio = summary.get("vs_plain")
    if "plain_step_time_ms" not in summary:
        return None
    if ratio is None:
        return "verdict: no comparison (too few steps after --warmup-steps to time)"
    change = abs(1 - ratio) * 100
    way = "faster than" if ratio < 1 else "slower than" if ratio > 1 else "as fast as"
    return (
        f"verdict: --pipeline {summary['pipeline']} took {summary['step_time_ms']:.1f} ms/step, "
        f"{ratio:.2f}x the plain loop's {summary['plain_step_time_ms']:.1f} ms: {change:.0f}% {way} it "
        f"(one run each on this machine; run-to-run noise can be 10-45%)"
    )
