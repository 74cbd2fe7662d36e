"""Start one `benchmarks.worker` process per rank and collect their records: the one rank launcher.

Ranks are subprocesses with the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
GLOO_SOCKET_IFNAME), each in its own session so that the launcher alone decides when they end: if
one rank fails, the others get `grace` seconds and are then killed; on a timeout, Ctrl-C, SIGTERM or
SIGHUP (a `timeout` around the benchmark: the ranks, in sessions of their own, do not get it) or any
exception here, every rank still running is killed before this returns. With a `Link`, each rank
starts inside its network namespace and gloo uses the veth; without one, the ranks use loopback.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.link import Link, signals_raise
from benchmarks.spec import RunSpec

__all__ = ["LaunchError", "cpu_hog", "free_port", "launch"]

_ROOT = Path(__file__).resolve().parent.parent
_LINK_PORT = 29577  # a fresh namespace has every port free


class LaunchError(RuntimeError):
    """A rank failed or did not finish in time."""


def launch(
    spec: RunSpec, *, world_size: int, link: Link | None = None, timeout: float = 3600.0, grace: float = 10.0
) -> list[list[dict[str, Any]]]:
    """Run `spec` on `world_size` local ranks; each rank's records, by rank.

    Raises:
        LaunchError: a rank exited non-zero (its traceback went to stderr) or the run took longer
            than `timeout` seconds.
    """
    with signals_raise(), tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(spec.to_json())
        outs = [Path(tmp) / f"rank{r}.json" for r in range(world_size)]
        port = _LINK_PORT if link else free_port()
        procs: list[subprocess.Popen] = []
        try:
            for rank in range(world_size):
                argv = [sys.executable, "-m", "benchmarks.worker", str(spec_path), str(outs[rank])]
                env = _rank_env(rank, world_size, port, link)
                argv = link.command(rank, argv) if link else argv
                procs.append(subprocess.Popen(argv, env=env, cwd=_ROOT, start_new_session=True))
            _wait(procs, timeout=timeout, grace=grace)
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        return [json.loads(out.read_text()) for out in outs]


@contextlib.contextmanager
def cpu_hog(core: int | None) -> Iterator[str | None]:
    """While the block runs, a busy loop pinned to `core` (None: nothing), so that the ranks share
    the machine with a neighbour, as on a loaded or noisy VM. Yields what was started, in words."""
    if core is None:
        yield None
        return
    loop = f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile True: pass"
    hog = subprocess.Popen([sys.executable, "-c", loop], start_new_session=True)
    try:
        yield f"one busy-looping process pinned to core {core}"
    finally:
        os.killpg(hog.pid, signal.SIGKILL)
        hog.wait()


def _rank_env(rank: int, world_size: int, port: int, link: Link | None) -> dict[str, str]:
    env = dict(os.environ)
    path = env.get("PYTHONPATH")
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_PORT=str(port))
    env.update(LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo")
    env.update(PYTHONUNBUFFERED="1", PYTHONPATH=f"{_ROOT}{os.pathsep}{path}" if path else str(_ROOT))
    env.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's start/stop banners, on every segment
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # "block allocated before profiling": expected
    return {**env, **(link.env(rank) if link else {})}


def _wait(procs: list[subprocess.Popen], *, timeout: float, grace: float) -> None:
    deadline, failed_at = time.monotonic() + timeout, None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = now  # the others are likely blocked in a collective with it
        if now > deadline or (failed_at is not None and now - failed_at > grace):
            break
        time.sleep(0.1)
    bad = {r: p.returncode for r, p in enumerate(procs) if p.returncode not in (None, 0)}
    if bad:
        raise LaunchError(f"rank(s) failed with exit codes {bad}; see the traceback above")
    hung = [r for r, p in enumerate(procs) if p.poll() is None]
    if hung:
        raise LaunchError(f"rank(s) {hung} still running after {timeout:.0f}s; killed")


def free_port() -> int:
    """A TCP port free on the loopback interface now (for a store or a rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
