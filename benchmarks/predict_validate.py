"""Predicted against measured: the sweep points' steps, predicted by `pipeline.predictor` and
measured by the benchmark launcher (`benchmarks.run.run_benchmark`), with each error, their median
and worst, and whether the predicted winner is the measured one.

Predictions are made in this process: the point's model is built at one rank (a process group of
one over an in-memory store), its dense part timed, its tables placed on the world size measured.
The link is probed first: an emulated one (`benchmarks.link`) by two ranks in its namespaces, since
a `tc` link's transfers are not linear in their size (its burst, TCP's queueing both ways).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.launch import free_port
from benchmarks.link import emulated_link
from benchmarks.points import SweepPoint
from benchmarks.run import run_benchmark
from benchmarks.spec import RunSpec

__all__ = ["VALIDATE_VARIANTS", "Check", "probe_emulated", "validate"]

VALIDATE_VARIANTS = (
    "ours-base",
    "ours-sparse-dist@early",
    "ours-sparse-dist@late",
    "ours-sparse-dist@early-shared",
    "ours-sparse-dist@late-own",
    "ours-prefetch@late",
    "ours-fused-sparse-dist",
    "ours-semi-sync",
)
"""What is measured per point: the forced schedules are predicted as such; Fused and SemiSync run
"auto" and are predicted under the schedule they ended on."""
_ROOT = Path(__file__).resolve().parent.parent


@dataclass(kw_only=True, slots=True)
class Check:
    """One (point, world size, variant): predicted and measured median step."""

    point: str
    world_size: int
    variant: str
    predicted_ms: float
    measured_ms: float

    @property
    def error(self) -> float:
        return self.predicted_ms / self.measured_ms - 1


def probe_emulated(rate: str | None, machine: Any) -> Any:
    """The link between two ranks over an emulated `rate` (None: loopback), probed by two processes
    (`python -m benchmarks.predict_validate --probe OUT`)."""
    from pipeline.predictor.link import Link

    with tempfile.TemporaryDirectory(prefix="probe-") as tmp:
        out = Path(tmp) / "link.json"
        argv = [
            sys.executable,
            "-m",
            "benchmarks.predict_validate",
            "--probe",
            str(out),
            str(machine.loopback.cpu_per_byte),
            str(machine.a2a_call),
        ]
        if rate is None:
            _run_pair(argv, None)
        else:
            with emulated_link(rate) as link:
                _run_pair(argv, link)
        raw = json.loads(out.read_text())
    return Link(**{**raw, "name": rate or "loopback", "curve": tuple(tuple(p) for p in raw["curve"])})


def _run_pair(argv: list[str], link: Any) -> None:
    port = 29578 if link else free_port()
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            GLOO_SOCKET_IFNAME="lo",
            PYTHONPATH=str(_ROOT),
        )
        if link is not None:
            env.update(link.env(rank))
        procs.append(subprocess.Popen(link.command(rank, argv) if link else argv, env=env, cwd=_ROOT))
    codes = [p.wait(timeout=300) for p in procs]
    if any(codes):
        raise RuntimeError(f"the link probe failed (exit codes {codes})")


def _probe_rank(out: str, cpu_per_byte: str, call: str) -> None:
    import torch
    import torch.distributed as dist

    from pipeline.predictor.link import probe_link

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        link = probe_link(cpu_per_byte=float(cpu_per_byte), call=float(call), budget_s=4.0)
        if dist.get_rank() == 0:
            Path(out).write_text(json.dumps(dataclasses.asdict(link)))
    finally:
        dist.destroy_process_group()


def validate(
    points: list[SweepPoint],
    *,
    world_sizes: tuple[int, ...],
    steps: int,
    warmup: int,
    rounds: int,
    predictor: Any,
    timeout: float = 3600.0,
) -> list[Check]:
    """Measure and predict every point at each world size (1 or 2; an emulated link needs 2).

    Args:
        predictor: `predictor(point, world_size, link)` -> `pipeline.predictor.Prediction`.
    """
    checks = []
    for world in world_sizes:
        for point in points:
            link = None if world == 1 else point.link
            spec = RunSpec(
                configs=(point.name,),
                variants=VALIDATE_VARIANTS,
                steps=steps,
                warmup=warmup,
                auto_warmup=warmup,
                rounds=rounds,
                profile_steps=0,
            )
            probed = predictor.link(link) if world > 1 else None
            print(f"[validate] {point.name} at {world} rank(s), link {link or 'loopback'}", flush=True)
            result = run_benchmark(spec, link=link, timeout=timeout, world_size=world)
            prediction = predictor.predict(point, world, probed)
            for row in result["summary"]:
                if row["status"] != "ok" or row["median_step_ms"] is None:
                    continue
                schedule = _schedule(result["runs"], row["variant"])
                predicted = _predicted(prediction, row["variant"], schedule)
                checks.append(
                    Check(
                        point=point.name,
                        world_size=world,
                        variant=row["variant"],
                        predicted_ms=predicted,
                        measured_ms=row["median_step_ms"],
                    )
                )
    return checks


def _schedule(runs: list[dict[str, Any]], variant: str) -> str:
    if "@" in variant:
        return variant.split("@")[1]
    kept = Counter(r.get("schedule") for r in runs if r["variant"] == variant and r.get("schedule"))
    return kept.most_common(1)[0][0] if kept else "late"


def _predicted(prediction: Any, variant: str, schedule: str) -> float:
    pipeline = variant.removeprefix("ours-").split("@")[0].replace("fused-sparse-dist", "fused")
    for step in prediction.steps:
        if step.pipeline == pipeline and step.schedule in (schedule, None):
            return step.step_ms
    raise ValueError(f"no prediction for {variant} under {schedule}")


def report(checks: list[Check], *, noise: float) -> list[str]:
    """The table, the median and worst error per world size, and the winner check per point."""
    lines = [f"{'point':<22} {'ranks':>5} {'variant':<32} {'predicted':>10} {'measured':>10} {'error':>7}"]
    for c in checks:
        lines.append(
            f"{c.point:<22} {c.world_size:>5} {c.variant:<32} {c.predicted_ms:>10.2f} "
            f"{c.measured_ms:>10.2f} {c.error:>+7.1%}"
        )
    for world in sorted({c.world_size for c in checks}):
        errors = [abs(c.error) for c in checks if c.world_size == world]
        lines.append(
            f"{world} rank(s): |error| median {statistics.median(errors):.1%}, worst {max(errors):.1%} "
            f"over {len(errors)} runs"
        )
    for point, world in sorted({(c.point, c.world_size) for c in checks}):
        group = [c for c in checks if c.point == point and c.world_size == world]
        lines.append(_winner_line(group, noise))
    return lines


def _winner_line(group: list[Check], noise: float) -> str:
    """Right if the measured fastest is among those predicted within `noise` of the predicted
    fastest; else how much slower the best of those measured, WRONG beyond `noise`."""
    fastest = min(c.predicted_ms for c in group)
    predicted = [c for c in group if c.predicted_ms <= fastest * (1 + noise)]
    measured = min(group, key=lambda c: c.measured_ms)
    best_of_predicted = min(predicted, key=lambda c: c.measured_ms)
    gap = best_of_predicted.measured_ms / measured.measured_ms - 1
    if measured in predicted:
        verdict = "right"
    elif gap <= noise:
        verdict = f"within noise ({gap:.1%} <= {noise:.0%})"
    else:
        verdict = f"WRONG ({gap:.1%} slower than the measured best)"
    named = ", ".join(c.variant for c in predicted[:3]) + (
        f" and {len(predicted) - 3} more" if len(predicted) > 3 else ""
    )
    where = f"{group[0].point} at {group[0].world_size}"
    return f"winner {where}: predicted {named}; measured {measured.variant}: {verdict}"


if __name__ == "__main__" and sys.argv[1:2] == ["--probe"]:
    _probe_rank(*sys.argv[2:5])
