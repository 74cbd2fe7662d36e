"""`python -m benchmarks.predict` (the `predict` command of `python -m benchmarks`): each pipeline's
predicted step (`pipeline.predictor`) for benchmark configs over world sizes and links, as a table and
a plot; with `--validate`, predicted against measured on sweep points.

    python -m benchmarks.predict --config sweep-1g-ids100 demo --world-size 2 8 64 512 1024 \
        --link 1gbit 10gbit --plot out/predict/predict.png
    python -m benchmarks.predict --validate --points lo-tiny 1g-ids100 --steps 20 --rounds 2

A config's model is built once at one rank in this process (a process group of one over an
in-memory store), its dense part timed; its tables are then placed on each world size. Exit status
2: a bad flag or name; 1: a validation run failed.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

__all__ = ["Predictor", "main", "register", "table"]

_PIPELINES = ("base", "sparse-dist", "prefetch", "fused", "semi-sync")


class Predictor:
    """Predictions for benchmark configs, from models built at one rank in this process."""

    def __init__(self, *, cores_per_rank: float | None, refresh: bool = False) -> None:
        import torch
        import torch.distributed as dist

        from pipeline.predictor import machine_costs

        torch.set_num_threads(1)  # as each benchmark rank runs
        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        self.machine = machine_costs(refresh=refresh)
        if self.machine.load > 0.5:
            print(
                f"predict: warning: this machine's costs were measured under a load of "
                f"{self.machine.load:.1f} per core; --refresh-costs on a quiet machine measures them again",
                file=sys.stderr,
            )
        self._cores = cores_per_rank
        self._built: dict[str, Any] = {}

    def _model(self, name: str) -> tuple[Any, Any]:
        if name not in self._built:
            import torch

            from benchmarks.configs import get_config
            from benchmarks.model import build_model, make_batches
            from pipeline.predictor import time_dense, workload_of

            config = get_config(name)
            built = build_model(config, device=torch.device("cpu"))
            batch = make_batches(config, count=1, rank=0)[0]
            self._built[name] = (workload_of(built.model, batch), time_dense(built.model, batch))
        return self._built[name]

    def link(self, rate: str | None) -> Any:
        """`rate` as the benchmark emulates it, probed (None: loopback)."""
        from benchmarks.predict_validate import probe_emulated

        return probe_emulated(rate, self.machine)

    def predict(self, point: Any, world_size: int, link: Any, *, config: str | None = None) -> Any:
        from pipeline.predictor import predict_workload

        workload, dense = self._model(config or point.name)
        workload = workload.at_world_size(world_size)
        cores = self._cores or (os.cpu_count() or 1) / min(world_size, 2)  # 2 ranks a host, as here
        return predict_workload(workload, self.machine, link or "loopback", dense=dense, cores_per_rank=cores)


def register(subparsers: Any) -> None:
    """Add the `predict` command to a `python -m benchmarks` parser's subparsers."""
    parser = subparsers.add_parser("predict", help=__doc__.splitlines()[0], description=__doc__)
    _arguments(parser)
    parser.set_defaults(run=_run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.predict",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _arguments(parser)
    return _run(parser.parse_args(sys.argv[1:] if argv is None else argv))


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        nargs="+",
        default=["demo", "sweep-1g-ids100", "compute-heavy"],
        metavar="NAME",
        help="benchmark configs or sweep points to predict (default: demo sweep-1g-ids100 compute-heavy)",
    )
    p.add_argument("--world-size", nargs="+", type=int, default=[2, 8, 64, 512, 1024], metavar="N")
    p.add_argument(
        "--link",
        nargs="+",
        default=["1gbit", "10gbit"],
        metavar="LINK",
        help="loopback, a rate (1gbit) or rate:latency (25gbit:10us); default 1gbit 10gbit",
    )
    p.add_argument(
        "--cores-per-rank", type=float, help="cores a rank's threads share (default: 2 ranks a host)"
    )
    p.add_argument("--refresh-costs", action="store_true", help="measure this machine's costs again (~15 s)")
    p.add_argument("--plot", default="out/predict/predict.png", help="where to write the plot ('' for none)")
    p.add_argument(
        "--validate", action="store_true", help="measure sweep points and compare (runs benchmarks)"
    )
    p.add_argument("--points", nargs="+", metavar="NAME", help="sweep points to validate (default all)")
    p.add_argument(
        "--validate-world-size",
        nargs="+",
        type=int,
        default=[2, 1],
        metavar="N",
        help="world sizes to validate at: 1 and/or 2 (default both)",
    )
    p.add_argument("--steps", type=int, default=20, help="validation: timed steps per run")
    p.add_argument("--warmup", type=int, default=10, help="validation: untimed steps before them")
    p.add_argument("--rounds", type=int, default=2, help="validation: rounds per point")
    p.add_argument("--noise", type=float, default=0.05, help="validation: gap under which winners tie")


def _run(args: argparse.Namespace) -> int:
    from benchmarks.points import POINTS, get_point

    try:
        predictor = Predictor(cores_per_rank=args.cores_per_rank, refresh=args.refresh_costs)
        if args.validate:
            points = [get_point(n) for n in args.points] if args.points else list(POINTS)
            return _validate(predictor, points, args)
        rows = _predictions(predictor, args)
    except ValueError as e:
        print(f"predict: {e}", file=sys.stderr)
        return 2
    print(table(rows))
    if args.plot:
        _plot(rows, args.plot)
        print(f"\nwrote {args.plot}")
    return 0


def _predictions(predictor: Predictor, args: argparse.Namespace) -> list[tuple[str, str, int, Any]]:
    from pipeline.predictor import parse_link

    rows = []
    for config in args.config:
        for name in args.link:
            link = parse_link(name, loopback=predictor.machine.loopback)
            for world in args.world_size:
                rows.append((config, name, world, predictor.predict(None, world, link, config=config)))
    return rows


def table(rows: list[tuple[str, str, int, Any]]) -> str:
    """Rows of (config, link, world size, `Prediction`): each pipeline's best step, the winner."""
    head = f"{'config':<20} {'link':<10} {'ranks':>6} " + " ".join(f"{p:>12}" for p in _PIPELINES)
    lines = [head + "  winner (critical stage)", "-" * (len(head) + 26)]
    for config, link, world, prediction in rows:
        cells = " ".join(f"{prediction.best(p).step_ms:>12.2f}" for p in _PIPELINES)
        w = prediction.winner
        lines.append(f"{config:<20} {link:<10} {world:>6} {cells}  {w.name} ({w.critical})")
    return "step ms per pipeline (its best input_dist schedule)\n" + "\n".join(lines)


def _plot(rows: list[tuple[str, str, int, Any]], path: str) -> None:
    """Per config and link: each pipeline's predicted step over Base's against world size, and the
    winner where it changes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(r[0] for r in rows))
    links = list(dict.fromkeys(r[1] for r in rows))
    fig, axes = plt.subplots(
        len(configs), len(links), figsize=(5 * len(links), 3.6 * len(configs)), squeeze=False
    )
    for (ci, config), (li, link) in ((c, lk) for c in enumerate(configs) for lk in enumerate(links)):
        ax = axes[ci][li]
        series = [(w, p) for c, lk, w, p in rows if c == config and lk == link]
        worlds = [w for w, _ in series]
        for pipeline in _PIPELINES:
            ratios = [p.best(pipeline).step_ms / p.best("base").step_ms for _, p in series]
            ax.plot(worlds, ratios, marker="o", label=pipeline)
        last = None
        for w, p in series:
            if p.winner.name != last:
                ratio = p.winner.step_ms / p.best("base").step_ms
                ax.annotate(
                    p.winner.name, (w, ratio), fontsize=7, xytext=(0, -14), textcoords="offset points"
                )
                last = p.winner.name
        base_ms = ", ".join(f"{p.best('base').step_ms:.0f}" for _, p in series)
        lowest = min(p.best(q).step_ms / p.best("base").step_ms for _, p in series for q in _PIPELINES)
        ax.set_ylim(min(lowest - 0.05, 0.9), 1.05)
        ax.ticklabel_format(axis="y", useOffset=False)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{config}, {link}\nBase ms: {base_ms}", fontsize=8)
        ax.set_xlabel("world size")
        ax.set_ylabel("step / Base's step")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(
        "predicted step per pipeline (its best schedule) over Base's; labels: the winner", fontsize=10
    )
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)


def _validate(predictor: Predictor, points: list[Any], args: argparse.Namespace) -> int:
    from benchmarks.launch import LaunchError
    from benchmarks.link import LinkUnavailable
    from benchmarks.predict_validate import report, validate
    from benchmarks.run import cpu_busy

    busy = cpu_busy()
    load = open("/proc/loadavg").read().split()[:3]
    print(f"[validate] CPUs {busy:.0%} busy, load average {' '.join(load)} before start", flush=True)
    try:
        checks = validate(
            points,
            world_sizes=tuple(args.validate_world_size),
            steps=args.steps,
            warmup=args.warmup,
            rounds=args.rounds,
            predictor=predictor,
        )
    except (LaunchError, LinkUnavailable) as e:
        print(f"predict: {e}", file=sys.stderr)
        return 1
    print("\n".join(report(checks, noise=args.noise)))
    load = open("/proc/loadavg").read().split()[:3]
    print(f"load average after: {' '.join(load)} (wall-time figures on a busy machine are not final)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
