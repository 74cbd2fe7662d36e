"""`python -m benchmarks predict`: each pipeline's predicted step (`benchmarks.predictor.predict`) for
benchmark configs over world sizes and links, as a table and a plot; with `--validate`, predicted
against measured.

The table's predictions are made in this process: each config's model built at one rank (a process
group of one over an in-memory store), its dense part timed once, its tables placed again on each
world size (`benchmarks.predictor`). The validation runs each sweep point's variants with `run`'s
machinery (`benchmarks.run.run_benchmark`, paired rounds); before the rounds the ranks call
`benchmarks.predictor.predict` on a fresh model of the point, as a job would (the link probed: at 2 ranks, the
emulated one), and each run's prediction is set beside its measured median step.
"""

from __future__ import annotations

import logging
import os
import statistics
import warnings
from collections import Counter
from typing import Any

from benchmarks.configs import SWEEP_LINKS, get_config, sweep_points
from benchmarks.measure import machine
from benchmarks.report import Paired, by_round, over_rounds, paired, publish, pyplot, save_figure
from benchmarks.run import run_benchmark
from benchmarks.spec import SCHEDULES, RunSpec, parse_variant

__all__ = ["PIPELINES", "VALIDATE_VARIANTS", "predict", "prediction_name", "prediction_table",
           "validation_table", "winner"]  # fmt: skip

PIPELINES = ("base", "sparse-dist", "prefetch", "fused", "semi-sync")
VALIDATE_VARIANTS = ("ours-base", *(f"ours-sparse-dist@{s}" for s in SCHEDULES), "ours-prefetch@late",
                     "ours-fused-sparse-dist", "ours-semi-sync")  # fmt: skip
"""Measured per point. Forced schedules are predicted as such; Fused and SemiSync run the default
("adaptive") and are predicted under the schedule they ended on."""
Row = tuple[str, str, int, Any]
"""(config, link, world size, `pipeline.Prediction`)."""


def predict(*, config: list[str], world_size: list[int], link: list[str], cores_per_rank: float | None,
            refresh_costs: bool, plot: str, validate: bool, points: list[str], validate_world_size: list[int],
            steps: int, warmup: int, rounds: int, seed: int, timeout: float, json: str | None,
            md: str | None, command: str) -> int:  # fmt: skip
    """The `predict` subcommand: the table and the plot, or with `validate` predicted against measured."""
    import torch

    from benchmarks.predictor import machine_costs

    torch.set_num_threads(1)  # as every benchmark rank runs: the costs are cached per thread count
    costs = machine_costs(refresh=refresh_costs)
    mode = "validate" if validate else "predict"
    json, md = (f"out/predict/{mode}.{s}" if p is None else p for p, s in ((json, "json"), (md, "md")))
    if validate:
        return _validate(sweep_points(points), validate_world_size, steps=steps, warmup=warmup, rounds=rounds,
                         seed=seed, timeout=timeout, json=json, md=md, command=command)  # fmt: skip
    rows = predictions(config, world_size, link, costs, cores_per_rank)
    meta = {"command": command, "machine": machine()}
    notes = ["ms: each pipeline's predicted step under its best input_dist schedule; winner: the fastest "
             "pipeline and schedule (PIPELINE@SCHEDULE: that class with input_dist_schedule=SCHEDULE), and "
             "the stage it spends most of its step on. In a job, benchmarks.predictor.pin.schedule_to_pin "
             "says whether to pin that schedule or keep the default.",
             *sorted({n for *_, p in rows for n in p.notes})]  # fmt: skip
    result = {"meta": meta, "predictions": [
        {"config": c, "link": lk, "world_size": w, "winner": p.winner.name, "critical": p.winner.critical,
         "step_ms": {s.name: s.step_ms for s in p.steps}} for c, lk, w, p in rows]}  # fmt: skip
    publish(result, meta, "Predicted steps", *prediction_table(rows), notes, json_path=json, md_path=md)
    if plot:
        plot_predictions(rows, plot)
    return 0


def _validate(names: list[str], world_sizes: list[int], *, steps: int, warmup: int, rounds: int, seed: int,
              timeout: float, json: str, md: str, command: str) -> int:  # fmt: skip
    """Run the points' variants at each world size (the ranks predict first), then the report."""
    if not set(world_sizes) <= {1, 2}:
        raise ValueError("--validate-world-size: 1 (one rank, loopback) or 2 (each point's link)")
    runs, meta = [], {}
    for world in world_sizes:
        links = {n: SWEEP_LINKS[n] if world == 2 else None for n in names}
        for rate in dict.fromkeys(links.values()):
            spec = RunSpec(configs=tuple(n for n in names if links[n] == rate), variants=VALIDATE_VARIANTS,
                           steps=steps, warmup=warmup, auto_warmup=warmup, rounds=rounds, profile_steps=0,
                           seed=seed, predict=True)  # fmt: skip
            result = run_benchmark(spec, world_size=world, link=rate, timeout=timeout, command=command)
            runs += [{**r, "world_size": world} for r in result["runs"]]
            meta = {**result["meta"], "where": "1 rank: loopback; 2 ranks: each point's link"}
    publish({"meta": meta, "runs": runs}, meta, "Predicted against measured", *validation_table(runs),
            json_path=json, md_path=md)  # fmt: skip
    return 0


def predictions(configs: list[str], world_sizes: list[int], links: list[str], costs: Any,
                cores_per_rank: float | None) -> list[Row]:  # fmt: skip
    """Each config at each link and world size, from its model built once at one rank here."""
    import torch
    import torch.distributed as dist

    from benchmarks.models import build_model, make_batches
    from benchmarks.predictor import predict_workload, time_dense, workload_of

    warnings.filterwarnings("ignore")  # torchrec's planner and DMP warn on every build, as in the worker
    logging.getLogger("torch").setLevel(logging.ERROR)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rows = []
    try:
        for name in configs:
            built = build_model(get_config(name), device=torch.device("cpu"))
            batch = make_batches(get_config(name), count=1, rank=0)[0]
            workload, dense = workload_of(built.model, batch), time_dense(built.model, batch)
            for rate in links:
                for world in world_sizes:
                    cores = cores_per_rank or (os.cpu_count() or 1) / min(world, 2)  # 2 ranks a host, as here
                    placed = workload.at_world_size(world)
                    prediction = predict_workload(placed, costs, rate, dense=dense, cores_per_rank=cores)
                    rows.append((name, rate, world, prediction))
    finally:
        dist.destroy_process_group()
    return rows


def prediction_table(rows: list[Row]) -> tuple[list[str], list[list[str]]]:
    """One line per (config, link, world size): each pipeline's best step, and the winner."""
    columns = ["config / link / ranks", *(f"{p} ms" for p in PIPELINES), "winner (critical stage)"]
    cells = [[f"{c} / {lk} / {w}", *(f"{p.best(q).step_ms:.2f}" for q in PIPELINES),
              f"{p.winner.name} ({p.winner.critical})"] for c, lk, w, p in rows]  # fmt: skip
    return columns, cells


def plot_predictions(rows: list[Row], path: str) -> None:
    """Per config and link: each pipeline's predicted step over Base's against the world size, with
    the winner named where it changes."""
    configs, links = list(dict.fromkeys(r[0] for r in rows)), list(dict.fromkeys(r[1] for r in rows))
    fig, axes = pyplot().subplots(len(configs), len(links), figsize=(5 * len(links), 3.6 * len(configs)),
                                  squeeze=False)  # fmt: skip
    for (ci, config), (li, rate) in ((c, lk) for c in enumerate(configs) for lk in enumerate(links)):
        ax, series = axes[ci][li], [(w, p) for c, lk, w, p in rows if (c, lk) == (config, rate)]
        lowest = 1.0
        for pipeline in PIPELINES:
            ratios = [p.best(pipeline).step_ms / p.best("base").step_ms for _, p in series]
            ax.plot([w for w, _ in series], ratios, marker="o", label=pipeline)
            lowest = min(lowest, *ratios)
        last = None
        for w, p in series:
            if p.winner.name != last:
                ax.annotate(p.winner.name, (w, p.winner.step_ms / p.best("base").step_ms), fontsize=7,
                            xytext=(0, -14), textcoords="offset points")  # fmt: skip
                last = p.winner.name
        base = ", ".join(f"{p.best('base').step_ms:.0f}" for _, p in series)
        ax.set_xscale("log", base=2)
        ax.set_ylim(min(lowest - 0.05, 0.9), 1.05)  # a flat panel (every pipeline ties) stays readable
        ax.ticklabel_format(axis="y", useOffset=False)
        ax.set(title=f"{config}, {rate}\nBase ms: {base}", xlabel="world size", ylabel="step / Base's step")
        ax.title.set_fontsize(8)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("predicted step per pipeline (best schedule) over Base's; labels: the winner", fontsize=10)
    save_figure(fig, path)


def prediction_name(variant: str, schedule: str | None) -> str:
    """The `PipelineStep.name` that predicts our `variant` run under `schedule` (its forced one first)."""
    name, forced, _ = parse_variant(variant)
    pipeline = name.removeprefix("ours-").replace("fused-sparse-dist", "fused")
    return pipeline if pipeline == "base" else f"{pipeline}@{forced or schedule or 'late'}"


def winner(predicted: dict[str, float], rounds: dict[Any, dict[str, float]]) -> str:
    """Is the predicted fastest variant the measured fastest (median over `rounds`)? Where it is not,
    the two are told apart only if their paired ratio is above 1 in every round (the gap exceeds the
    rounds' spread): "WRONG"; else a tie within the spread."""
    ours = min(predicted, key=predicted.__getitem__)
    medians = {v: statistics.median(r[v] for r in rounds.values() if v in r) for v in predicted}
    best = min(medians, key=medians.__getitem__)
    said = f"predicted {ours}, measured {best}"
    if ours == best:
        return f"{said}: right"
    gap = paired(rounds, ours, best)
    if gap is None:
        return f"{said}: never in the same round"
    if gap.low <= 1:
        return f"{said}: a tie within the rounds' spread ({ours} / {best} {gap:.3f})"
    return f"{said}: WRONG ({ours} / {best} {gap:.3f}, slower in every round)"


def validation_table(runs: list[dict[str, Any]]) -> tuple[list[str], list[list[str]], list[str]]:
    """Per (world size, point, variant): predicted and measured step, the error; in the notes the
    median and worst |error| per world size and the winner per point (`winner`)."""
    cells, errors, verdicts = [], {}, []
    for world, point in dict.fromkeys((r["world_size"], r["config"]) for r in runs):
        mine = [r for r in runs if (r["world_size"], r["config"]) == (world, point) and r["status"] == "ok"]
        rounds, predicted = by_round(mine, "step_ms"), {}
        for variant in dict.fromkeys(r["variant"] for r in mine):
            ran = [r for r in mine if r["variant"] == variant]
            kept = Counter(r["schedule"] for r in ran if r.get("schedule")).most_common(1)
            name = prediction_name(variant, kept[0][0] if kept else None)
            predicted[variant] = ran[0]["predicted_ms"][name]
            measured: Paired = over_rounds([r[variant] for r in rounds.values() if variant in r])  # type: ignore[assignment]
            error = predicted[variant] / measured.median - 1
            errors.setdefault(world, []).append(abs(error))
            where = f"{world} / {point.removeprefix('sweep-')} / {variant}"
            cells.append([where, f"{predicted[variant]:.2f}", f"{measured:.2f}", f"{error:+.1%}"])
        verdicts.append(f"winner, {point.removeprefix('sweep-')} at {world}: {winner(predicted, rounds)}")
    notes = [f"{w} rank(s): |error| median {statistics.median(e):.1%}, worst {max(e):.1%} over {len(e)} runs"
             for w, e in errors.items()]  # fmt: skip
    notes.append("error: predicted over the measured median, minus 1. A winner is WRONG only where the "
                 "predicted fastest was slower than the measured one in every round (paired).")  # fmt: skip
    return ["ranks / point / variant", "predicted ms", "measured ms", "error"], cells, [*notes, *verdicts]
