"""Calls per step of one benchmark variant, on every thread, counted rather than timed.

    PYTHONPATH=. .venv/bin/python scripts/count_calls.py plain /var/tmp/count-plain out/plain.json
    PYTHONPATH=. .venv/bin/python scripts/count_calls.py ours-prefetch+inline /var/tmp/count-in out/in.json
    PYTHONPATH=. .venv/bin/python scripts/count_calls.py --compare out/plain.json out/in.json

One process, a gloo world of one, the benchmark's model of `--config` (`benchmarks.models`, tables on
disk for the `tiered*` configs) and its batches. A profile hook installed before any thread starts
counts every Python and C call per thread kind (main, tiered-reader, tiered-writer, pipeline-prefetch)
over `--steps` steps after `--warmup` (the caches full by then). Every store's queued writes are
waited for before and after the counted steps, so the writer's calls belong to those steps only.
Counts do not depend on the machine's load, except where the work itself depends on timing (how many
queued writes a read overlays). A tool beside the library: nothing imports it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import socket
import sys
import threading
from typing import Any

_counting = False
_counts: collections.Counter[tuple[str, str]] = collections.Counter()


def _thread_kind() -> str:
    return re.sub(r"[_-]?\d+(_\d+)?$", "", threading.current_thread().name)


def _where(code: Any) -> str:
    path = code.co_filename
    short = path.split("site-packages/")[-1] if "site-packages/" in path else os.path.relpath(path)
    return f"{short}:{code.co_name}"


def _hook(frame: Any, event: str, arg: Any) -> None:
    if not _counting:
        return
    if event == "call":
        _counts[(_thread_kind(), _where(frame.f_code))] += 1
    elif event == "c_call":
        _counts[(_thread_kind(), f"C:{getattr(arg, '__qualname__', repr(arg))}")] += 1


def count(variant: str, store_dir: str, *, config_name: str, warmup: int, steps: int) -> dict[str, Any]:
    """Per-step call counts of `variant`, keyed "thread|function"."""
    global _counting
    threading.setprofile(_hook)
    sys.setprofile(_hook)
    import torch
    import torch.distributed as dist

    from benchmarks.configs import CONFIGS
    from benchmarks.models import build_model, make_batches
    from benchmarks.variants import make_runner

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    config = CONFIGS[config_name]
    os.makedirs(store_dir, exist_ok=True)
    built = build_model(config, device=torch.device("cpu"), store_dir=store_dir)
    runner = make_runner(variant, built.model, built.optimizer, torch.device("cpu"), captured=None)
    batches = iter(make_batches(config, count=warmup + steps + 4, rank=0))
    for _ in range(warmup):
        runner.step(batches)
    kernels = [k for m in built.model.modules() if hasattr(m, "tiered_kernels") for k in m.tiered_kernels()]
    stores = list({id(c.store): c.store for k in kernels for c in k.caches}.values())
    for store in stores:
        store.sync()
    _counting = True
    for _ in range(steps):
        runner.step(batches)
    for store in stores:
        store.sync()
    _counting = False
    sys.setprofile(None)
    threading.setprofile(None)
    return {
        "variant": variant,
        "config": config_name,
        "steps": steps,
        "warmup": warmup,
        "caches_full": all(k.caches_full() for k in kernels) if kernels else None,
        "per_step": {f"{t}|{f}": n / steps for (t, f), n in sorted(_counts.items())},
    }


def compare(first: dict[str, Any], second: dict[str, Any], top: int) -> None:
    """Print per-thread totals of both and the functions whose counts differ most."""
    a, b = first["per_step"], second["per_step"]
    for record in (first, second):
        totals: collections.Counter[str] = collections.Counter()
        for key, n in record["per_step"].items():
            totals[key.split("|")[0]] += n
        print(record["variant"], {t: round(n, 1) for t, n in totals.items()})
    rows = sorted(((b.get(k, 0) - a.get(k, 0), k) for k in set(a) | set(b)), key=lambda r: -abs(r[0]))
    for diff, key in rows[:top]:
        print(f"{diff:+9.1f} {a.get(key, 0):9.1f} {b.get(key, 0):9.1f}  {key}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("args", nargs="+", help="VARIANT STORE_DIR OUT.json, or with --compare A.json B.json")
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--config", default="tiered")
    parser.add_argument("--warmup", type=int, default=130)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    if args.compare:
        first, second = (json.loads(open(p).read()) for p in args.args)
        compare(first, second, args.top)
        return
    variant, store_dir, out = args.args
    record = count(variant, store_dir, config_name=args.config, warmup=args.warmup, steps=args.steps)
    with open(out, "w") as f:
        json.dump(record, f, indent=0)
    print(f"{variant}: {sum(record['per_step'].values()):.1f} calls per step, written to {out}")
    os._exit(0)  # the reader and writer pools are not daemons; the counts are written


if __name__ == "__main__":
    main()
