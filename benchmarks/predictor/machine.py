"""What one operation costs on this machine (`MachineCosts`), measured once by micro-benchmarks
(`benchmarks.predictor.calibrate`, in a process of its own) and cached in a file, one entry per set of
machine facts: `~/.cache/torchrec-pipeline/costs-<host>.json` (`$TORCHREC_PIPELINE_CACHE` moves the
folder).

The micro-benchmarks run torchrec's own code at one rank (a sharded EmbeddingBagCollection's lookup
and its backward with the fused optimizer, KeyedJaggedTensor permutes), a stack of linear layers,
an optimizer step, a gloo all-to-all call, and a two-process all-to-all over loopback TCP (the
`loopback` link). Each is timed at a few sizes and fitted as a fixed cost plus costs per unit.
Several ranks of one job may ask at once: a file lock lets one measure and the others read.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.predictor.link import Link

__all__ = ["CollectiveCost", "MachineCosts", "cache_path", "calibrate", "machine_costs", "machine_facts"]

_VERSION = 6
_BUSY, _QUIET = 0.5, 0.25
"""Runnable processes per core above which measured costs are suspect, and below which to measure."""
"""Bumped when the micro-benchmarks change: older cache files are measured again."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveCost:
    """One collective at its smallest, between two ranks of this machine."""

    host: float
    """CPU seconds of the thread that calls it (torchrec's and gloo's host work), for a module of
    two features."""
    latency: float
    """Wall seconds beyond `host` (the round trip to the peer)."""
    host_feature: float = 0.0
    """`host` per feature beyond two (torchrec's work per feature: splits, permute indices)."""
    host_unit: float = 0.0
    """`host` per id of this rank's batch (start, splits), per id received (values: the assembly),
    per pooled float sent (output): torchrec's permutes and copies around the all-to-all."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MachineCosts:
    """Seconds per operation on one rank of this machine (one intra-op thread unless `facts` say
    otherwise). A cost `x_call` is paid once per call, `x_table` per table, `x_id` per id, `x_elem`
    per id and column."""

    lookup_fwd_call: float
    lookup_fwd_table: float
    lookup_fwd_id: float
    lookup_fwd_elem: float
    """The pooled embedding lookup of one sharded module (its table-batched kernel)."""
    lookup_bwd_call: float
    lookup_bwd_table: float
    lookup_bwd_id: float
    lookup_bwd_elem: float
    """Its backward, the fused optimizer's update included."""
    permute_call: float
    permute_id: float
    """A KeyedJaggedTensor permute: grouping a batch's ids by destination rank before the values
    all-to-all, and putting the received ids back in feature order after it."""
    input_dist_call: float
    """torchrec's host work to start one module's input_dist (contexts, awaitables, the splits)."""
    output_call: float
    """torchrec's host work around one module's output all-to-all (forward or backward)."""
    dense_op: float
    dense_flop: float
    """Forward and backward of a small dense operation (a linear layer, an activation, a loss),
    and per floating-point operation: the fallback where the model's dense part cannot be timed
    itself (`benchmarks.predictor.dense`)."""
    optimizer_tensor: float
    optimizer_param: float
    """The dense optimizer's step: per parameter tensor and per parameter."""
    a2a_call: float
    """One gloo all-to-all call's host cost, nothing sent."""
    kjt_check_id: float
    """The ranks' check of each batch's ids (`RankOptions.check_kjts`), per id."""
    loopback: Link
    """Two processes on this machine over loopback TCP (the `loopback` link)."""
    start: CollectiveCost
    splits: CollectiveCost
    values: CollectiveCost
    """A sharded module's input_dist at two ranks: starting it (issues the splits all-to-all),
    waiting for the splits (issues the values all-to-all), waiting for the values (the assembly)."""
    output: CollectiveCost
    """Its pooled-embedding all-to-all."""
    allreduce: CollectiveCost
    """A small all-reduce (one DDP bucket)."""
    tiny_step_one_rank: float
    tiny_step_two_ranks: float
    tiny_dense: float
    """The plain loop's step on the smallest sharded model (two tables, one linear layer) at one
    and at two ranks, and its dense forward and backward: what a step costs beyond its stages
    measured one by one (`benchmarks.predictor.costs.step_overhead`)."""
    facts: dict[str, Any]
    """The machine facts it was measured under (`machine_facts()`)."""
    load: float = 0.0
    """Runnable processes per core (the 1-minute load average over the cores) when it was measured:
    above about 0.5 other work inflated the figures (`machine_costs(refresh=True)` on a quiet
    machine measures again)."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> MachineCosts:
        loopback = {**raw["loopback"], "curve": tuple(tuple(p) for p in raw["loopback"].get("curve", ()))}
        pairs = {k: CollectiveCost(**raw[k]) for k in ("start", "splits", "values", "output", "allreduce")}
        return cls(**{**raw, **pairs, "loopback": Link(**loopback)})


def machine_facts() -> dict[str, Any]:
    """What the costs depend on: host, CPU model, cores, intra-op threads, library versions."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "version": _VERSION,
        "host": socket.gethostname(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "torchrec": _version("torchrec"),
        "fbgemm": _version("fbgemm-gpu-cpu") or _version("fbgemm-gpu"),
    }


def cache_path(facts: dict[str, Any] | None = None) -> Path:
    """Where this machine's costs are kept."""
    folder = Path(os.environ.get("TORCHREC_PIPELINE_CACHE") or Path.home() / ".cache" / "torchrec-pipeline")
    host = (facts or machine_facts())["host"]
    return folder / f"costs-{host}.json"


def machine_costs(*, refresh: bool = False, path: Path | None = None, timeout: float = 300.0) -> MachineCosts:
    """This machine's costs: read from the cache, or measured now (about 10-20 s, in a child
    process) and added to it. The cache keeps one entry per set of facts (a thread count, a library
    version), so each is measured once; an entry measured under load (over 0.5 runnable processes
    per core) is measured again the first time the machine is quiet (under 0.25).

    Args:
        refresh: measure even if the cache holds costs for these facts.
        path: the cache file (default `cache_path()`).
        timeout: seconds the measuring process may take.

    Raises:
        RuntimeError: the measuring process failed; its output is in the message.
    """
    facts = machine_facts()
    path = path or cache_path(facts)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one rank measures, the others wait and read
        entries = _read(path)
        cached = next((e for e in entries if e.facts == facts), None)
        noisy = cached is not None and cached.load > _BUSY and _load() < _QUIET  # measured under load
        if cached is not None and not refresh and not noisy:
            return cached
        costs = _measure(facts, timeout)
        kept = [e.to_json() for e in entries if e.facts != facts] + [costs.to_json()]
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(kept, indent=1))
        tmp.replace(path)
        return costs


def _read(path: Path) -> list[MachineCosts]:
    """The cache's entries; none if it is missing or unreadable (it is then measured again)."""
    try:
        return [MachineCosts.from_json(raw) for raw in json.loads(path.read_text())]
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return []


def _measure(facts: dict[str, Any], timeout: float) -> MachineCosts:
    load = _load()
    with tempfile.TemporaryDirectory(prefix="pipeline-costs-") as tmp:
        out = Path(tmp) / "costs.json"
        argv = [sys.executable, "-m", "benchmarks.predictor.calibrate", str(out), str(facts["threads"])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, check=False)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(
                f"measuring this machine's costs failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}"
            )
        raw = json.loads(out.read_text())
    return MachineCosts.from_json({**raw, "facts": facts, "load": max(load, _load())})


def _load() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0]) / (os.cpu_count() or 1)
    except (OSError, ValueError, IndexError):
        return 0.0


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def calibrate(*, refresh: bool, path: str | None, command: str) -> int:
    """`python -m benchmarks calibrate`: this machine's costs, measured (or read from the cache) and
    printed with the cache's path. Run it before `predict` on a machine where a job will run; a
    training job never measures anything itself."""
    where = Path(path) if path else cache_path(machine_facts())
    costs = machine_costs(refresh=refresh, path=where)
    print(f"{command}\ncache: {where}\n{json.dumps(costs.to_json(), indent=1, default=str)}")
    return 0
