"""`python -m benchmarks <what> ...`: the one entry point, and the only place that parses flags.

    run         configs x variants on local ranks, paired interleaved rounds (`make bench`)
    overhead    process CPU and wall per step on a tiny model: each loop over the plain one
    sweep       14 points from network-bound to compute-bound, with the bound and the schedules
    tiered      tables on disk at world size 1 and 2, Prefetch against its bound
    hit-rates   each cache policy's hit rate against Belady's optimum (offline, no I/O)
    big-tables  tables far larger than RAM, trained in one process; peak RSS
    agreement   the ranks' per-batch vote at 2-16 local ranks, against a request to rank 0's store
    riding      the agreement's host work per batch where statuses ride, 8-1,024 simulated ranks
    step-path   the files and functions one steady step enters: ours against torchrec's
    first-step  time to first output in fresh torchrun jobs: plain, our pipelines, torchrec's
    selfcheck   the benchmarks' own arithmetic and link setup, against fakes (no ranks, no root)
    figures     re-run the command each docs/results/*.md states, one at a time (`make figures`)

A subcommand is a module with one function taking keyword arguments named as its flags' `dest`,
plus `command` (the command line, for the report); `_SUBCOMMANDS` maps the name to its parser and
function. To add one: a module, a `_<name>(sub)` parser below, an entry in the map.
Exit status: 0 done; 1 a rank failed or a check missed; 2 could not start (bad flag, no link).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
from collections.abc import Callable
from typing import Any

__all__ = ["main"]

_AUTO_WARMUP = "untimed steps of every variant of a config where one measures first (default %(default)s)"
_STORE = os.environ.get("BENCH_STORE_DIR") or os.path.join(tempfile.gettempdir(), "bench-tiered")


def _common(p: argparse.ArgumentParser, *, steps: int, warmup: int, rounds: int, json: str, md: str) -> None:
    """Flags every training suite takes."""
    p.add_argument("--steps", type=int, default=steps, help=f"timed steps per run (default {steps})")
    p.add_argument("--warmup", type=int, default=warmup, help=f"untimed steps before them (default {warmup})")
    p.add_argument("--rounds", type=int, default=rounds, help=f"rounds, order rotated (default {rounds})")
    p.add_argument("--seed", type=int, default=0, help="seeds models and batches (default 0)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before the ranks are killed")
    p.add_argument("--json", default=json, help=f"every run, as JSON (default {json}; '' for none)")
    p.add_argument("--md", default=md, help=f"the report, as Markdown (default {md}; '' for none)")


def _names(p: argparse.ArgumentParser, flag: str, help: str) -> None:
    """A flag taking names (configs, variants, points); none given: the subcommand's default ones."""
    p.add_argument(flag, nargs="+", default=[], metavar="NAME", help=help)


def _run(p: argparse.ArgumentParser) -> None:
    _common(p, steps=30, warmup=20, rounds=4, json="out/bench/results.json", md="out/bench/results.md")
    _names(p, "--configs", "configs (default: demo input-dist-heavy compute-heavy; benchmarks/configs.py)")
    _names(p, "--variants", "NAME[@SCHEDULE][+FLAG...] (benchmarks/spec.py; default: docs/benchmarks.md's 7)")
    p.add_argument("--auto-warmup", type=int, default=250, help=_AUTO_WARMUP)
    p.add_argument("--profile-steps", type=int, default=5, help="steps of the profiled segment; 0: none")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: nccl, one GPU per rank")
    p.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--link", metavar="RATE", help="emulate a link of this tc rate between 2 ranks (root)")
    p.add_argument("--trace-dir", help="write the profiled segments' chrome traces here")
    p.add_argument("--store-dir", default=_STORE, help="stores of the tables on disk ($BENCH_STORE_DIR)")
    p.add_argument("--cpu-hog", type=int, metavar="CORE", help="a busy loop pinned to this core meanwhile")


def _overhead(p: argparse.ArgumentParser) -> None:
    _common(p, steps=300, warmup=120, rounds=5, json="", md="")
    p.add_argument("--world-size", type=int, default=1, help="ranks (default 1)")
    loops = (
        "loops besides plain (default ours and torchrec's Base and SparseDist, ours Prefetch and "
        "FusedSparseDist); e.g. ours-base+nocheck"
    )
    _names(p, "--variants", loops)
    _names(p, "--configs", "models (default tiny); tiny-split, -built, -shared: as users write them, vs tiny")
    p.add_argument("--cprofile", metavar="VARIANT", help="run this loop once under cProfile instead")
    p.add_argument("--top", type=int, default=30, help="cProfile rows shown (default 30)")
    p.add_argument("--sort", choices=("own", "cum"), default="own", help="cProfile rows by own or cumulative")
    p.add_argument("--only", nargs="*", default=[], metavar="PREFIX", help="rows of these paths only")


def _sweep(p: argparse.ArgumentParser) -> None:
    _common(p, steps=20, warmup=5, rounds=3, json="out/sweep/sweep.json", md="out/sweep/sweep.md")
    _names(p, "--points", "points (default all 14)")
    p.add_argument("--auto-warmup", type=int, default=75, help=_AUTO_WARMUP)
    p.add_argument("--png", default="out/sweep/sweep.png", help="the plot ('' for none)")


def _tiered(p: argparse.ArgumentParser) -> None:
    _common(p, steps=15, warmup=250, rounds=2, json="out/bench/tiered.json", md="out/bench/tiered.md")
    _names(p, "--configs", "configs with tables on disk (default tiered tiered-skewed tiered-balanced)")
    p.add_argument("--world-sizes", nargs="+", type=int, default=[1, 2], help="default 1 2")
    p.add_argument("--store-dir", default=_STORE, help="stores (local disk; $BENCH_STORE_DIR)")


def _hit_rates(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="tiered-skewed", help="a config with tables on disk")
    p.add_argument("--batches", type=int, default=1500, help="batches replayed (default 1500)")
    p.add_argument("--skip", type=int, default=500, help="batches before the counted ones (default 500)")
    p.add_argument("--tables", type=int, default=8, help="tables replayed (default 8)")
    p.add_argument("--fractions", type=float, nargs="+", default=[], help="cache sizes (default: config's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the result here")
    p.add_argument("--md", help="also write the table here")


def _big_tables(p: argparse.ArgumentParser) -> None:
    p.add_argument("--total-gb", type=float, default=16.0, help="GiB of store files in all (default 16)")
    p.add_argument("--store-dir", required=True, help="directory for the store files (local disk)")
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--cache-rows", type=int, default=50_000, help="RAM rows per table (default 50000)")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--ids", type=int, default=4, help="ids per table per sample")
    p.add_argument("--steps", type=int, default=50, help="timed steps")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rss-limit-gb", type=float, default=2.0)
    p.add_argument("--keep", action="store_true", help="keep the store files")
    p.add_argument("--checkpoint-dir", help="after training, save a checkpoint here and load it back")


def _selfcheck(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", help="also write each check's outcome here")


def _function(module: str, name: str) -> Callable[..., int]:
    def call(**kwargs: Any) -> int:
        import importlib

        return getattr(importlib.import_module(f"benchmarks.{module}"), name)(**kwargs)

    return call


def _agreement(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-sizes", nargs="+", type=int, default=[2, 4, 8, 16], metavar="N")
    p.add_argument("--votes", type=int, default=300, help="votes per world size (default 300)")
    p.add_argument("--json", default="out/bench/agreement.json", help="'' for none")
    p.add_argument("--md", default="out/bench/agreement.md", help="'' for none")


def _riding(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-sizes", nargs="+", type=int, default=[8, 64, 1024], metavar="N")
    p.add_argument("--batches", type=int, default=2000, help="batches a round (default 2000)")
    p.add_argument("--rounds", type=int, default=5, help="rounds per world size and state (default 5)")
    p.add_argument("--json", default="out/bench/riding.json", help="'' for none")
    p.add_argument("--md", default="out/bench/riding.md", help="'' for none")


def _step_path(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cls", default="TrainPipelineSparseDist", help="the class, by torchrec's name")
    p.add_argument("--config", default="demo", help="the benchmark config's model and batches (default demo)")
    p.add_argument("--steps", type=int, default=40, help="steps before the one counted (default 40)")
    p.add_argument(
        "--schedules",
        nargs="+",
        default=["late", "decided", "adaptive"],
        help="ours, one count each: late, decided (the default, its watch decided), adaptive",
    )
    p.add_argument("--functions", action="store_true", help="print each function entered, not each file")
    p.add_argument("--json", default="out/bench/step_path.json", help="'' for none")
    p.add_argument("--md", default="out/bench/step_path.md", help="'' for none")


def _first_step(p: argparse.ArgumentParser) -> None:
    _names(p, "--variants", "plain ours-sparse-dist ours-prefetch torchrec-sparse-dist (default: all)")
    p.add_argument("--rounds", type=int, default=3, help="jobs per variant, order rotated (default 3)")
    p.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--json", default="out/bench/first_step.json", help="'' for none")
    p.add_argument("--md", default="out/bench/first_step.md", help="'' for none")


def _figures(p: argparse.ArgumentParser) -> None:
    p.add_argument("--list", dest="list_only", action="store_true", help="print the plan; run nothing")
    p.add_argument("--only", nargs="+", default=[], metavar="NAME", help="these files only (e.g. vote.md)")
    p.add_argument("--results", help="the folder of results files (default docs/results)")


_SUBCOMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Callable[..., int]]] = {
    "run": (_run, _function("run", "run")),
    "overhead": (_overhead, _function("overhead", "overhead")),
    "sweep": (_sweep, _function("sweep", "sweep")),
    "tiered": (_tiered, _function("tiered", "tiered")),
    "hit-rates": (_hit_rates, _function("hit_rates", "hit_rates")),
    "big-tables": (_big_tables, _function("big_tables", "big_tables")),
    "selfcheck": (_selfcheck, _function("selfcheck", "selfcheck")),
    "agreement": (_agreement, _function("agreement", "agreement")),
    "riding": (_riding, _function("riding", "riding")),
    "step-path": (_step_path, _function("step_path", "step_path")),
    "first-step": (_first_step, _function("first_step", "first_step")),
    "figures": (_figures, _function("figures", "figures")),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    listing, raw = __doc__.split("\n\n")[1], argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=listing, formatter_class=raw)
    subs = parser.add_subparsers(dest="what", required=True, metavar="<what>")
    helps = dict(line.split(None, 1) for line in listing.splitlines())
    for name, (add_flags, _) in _SUBCOMMANDS.items():
        add_flags(subs.add_parser(name, help=helps[name], description=helps[name]))
    args = vars(parser.parse_args(argv))
    _, function = _SUBCOMMANDS[args.pop("what")]
    from benchmarks.launch import LaunchError
    from benchmarks.link import LinkUnavailable

    try:
        return function(**args, command=shlex.join(["python", "-m", "benchmarks", *argv]))
    except (ValueError, LinkUnavailable) as e:
        print(f"benchmarks: {e}", file=sys.stderr)
        return 2
    except LaunchError as e:
        print(f"benchmarks: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # ranks and link are gone by now: launch and emulated_link clean up
        print("benchmarks: interrupted", file=sys.stderr)
        return 130
    except SystemExit as e:  # SIGTERM or SIGHUP during a launch (benchmarks.link.signals_raise)
        print(f"benchmarks: stopped by a signal (exit {e.code}); the ranks were killed", file=sys.stderr)
        raise


if __name__ == "__main__":
    sys.exit(main())
