"""Run test scenarios on N gloo (or NCCL) ranks in processes of their own, one scenario a test.

`RankPool(world_size)` keeps one set of rank processes, joined in a process group through a store
the pool hosts in the test process (as torchrun's agent hosts one, so a rank that ends, rank 0 too,
leaves it to the peers still reading a failure from it), and runs scenarios on them one at a time:
`pool.run(fn, *args)` calls `fn(rank, world_size, *args)` on every rank and returns the per-rank
return values. Each scenario's outcome is recorded by each rank on its own (a result file, or its
traceback), so a scenario that raises, hangs or kills a rank fails exactly the test that ran it,
naming the scenario; the pool then stops its ranks and the next scenario starts fresh ones, so every
later scenario still runs, on ranks in a known state.

Ranks are forked from one server process per pytest session that imported torch and torchrec once
(`multiprocessing`'s forkserver): a pair of ranks starts in about a second, where a spawned pair
imports them again (6-10 s on two cores). Scenarios that pass also share the ranks; a failure pays
for a restart. Scenarios that end a rank on purpose (a process group destroyed after a failure, a rank
killed) are run with `run_ranks` (a pool of its own, stopped afterwards); a rank whose process group
is gone after a scenario also ends itself, so the pool restarts.

Timeouts: `pool.run(..., timeout=T)` waits at most `START_TIMEOUT` for the ranks to start and join,
`T` for the scenario and `grace` for the peers of a failed rank, then kills them. `pytest_timeout(T)`
is the pytest-timeout a test must have for the harness to fire first (pytest-timeout counts fixture
setup, where a module's pool starts), so a hang fails as "scenario X hung", not as a pytest stack dump.

`fn` must be importable by name (a module-level function): the server forks a rank before the
test's module is imported there. Its return value must be loadable by `torch.load(weights_only=False)`.
A rank takes the environment of the test that starts it, but what torch read from the environment on
import is the server's.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "START_TIMEOUT",
    "RankError",
    "RankPool",
    "RankTimeout",
    "free_port",
    "pytest_timeout",
    "run_ranks",
    "run_script",
    "script_job",
]

START_TIMEOUT = 90.0
"""Seconds for the ranks to start: the fork server's first start (it imports torch and torchrec),
then the fork and the process group's rendezvous."""
_GRACE = 5.0
_POLL = 0.02


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1 (the store of a scenario's ranks)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankError(RuntimeError):
    """A rank raised, died or was killed during a scenario; the message carries its traceback or
    how it ended."""

    def __init__(self, message: str, results: dict[int, Any] | None = None) -> None:
        super().__init__(message)
        self.results = results or {}
        """The return values of the ranks that finished the scenario, by rank."""


class RankTimeout(RuntimeError):
    """A rank did not finish a scenario (or start) within the harness timeout."""


def pytest_timeout(timeout: float, *, grace: float = _GRACE) -> int:
    """The pytest-timeout (seconds) for a test whose scenarios run under harness `timeout`: above
    the harness's whole join (start, scenario, grace, kill) plus a margin, so the harness fires first."""
    return int(START_TIMEOUT + timeout + grace + 30)


_PRELOAD = ["torch", "torch.distributed", "torchrec", "tests.harness"]
"""What the fork server imports once. Nothing here starts CUDA, torch's threads or a process group,
so each fork starts clean."""


def _context(backend: str = "gloo") -> Any:
    """The fork server for CPU ranks. NCCL ranks are spawned: a fork of a process in which CUDA has
    started cannot use CUDA, and importing fbgemm-gpu's CUDA build may start it in the server."""
    if backend == "nccl":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _host_store(world_size: int) -> Any:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)


def _scenario_name(fn: Callable[..., Any], args: tuple) -> str:
    shown = ", ".join(repr(a) for a in args)
    return f"{fn.__name__}({shown})" if shown else fn.__name__


def _write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    write(tmp)
    os.replace(tmp, path)  # the parent never reads a half-written file


def _serve(
    rank: int,
    world_size: int,
    port: int,
    out_dir: str,
    inbox: Any,
    backend: str,
    env: dict,
    pg_timeout: float | None,
) -> None:
    """A rank's loop: join the group, then run each request (seq, pickled (fn, args)) until None."""
    import torch
    import torch.distributed as dist

    # A rank is forked from the session's fork server, which holds the environment of its own start:
    # take the test's, as a spawned rank would.
    os.environ.clear()
    os.environ.update(env)

    # Ranks share two cores: one intra-op thread each keeps them from thrashing, and makes results
    # independent of how many threads a reduction happened to use.
    torch.set_num_threads(1)
    out = Path(out_dir)
    seq = "start"
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        timeout = {} if pg_timeout is None else {"timeout": datetime.timedelta(seconds=pg_timeout)}
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, **timeout)
        (out / f"start-{rank}.ok").write_text("")
        while (request := inbox.get()) is not None:
            seq, payload = request
            fn, args = pickle.loads(payload)
            result = fn(rank, world_size, *args)
            _write_atomically(out / f"{seq}-{rank}.pt", lambda p, r=result: torch.save(r, p))
            if not dist.is_initialized():  # the scenario destroyed the process group: the pool restarts
                (out / f"ended-{rank}").write_text("")
                return
    except BaseException:
        _write_atomically(out / f"{seq}-{rank}.err", lambda p: p.write_text(traceback.format_exc()))
        os._exit(1)  # skip process-group teardown, which can block on peers that are gone
    if dist.is_initialized():
        dist.destroy_process_group()


def _how_it_ended(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by signal {signal.Signals(-exitcode).name} (exit status {exitcode})"
    return f"exited with status {exitcode} without a result"


class RankPool:
    """`world_size` rank processes in one process group that run scenarios one at a time.

    Started on the first `run()`; stopped (and restarted by the next `run()`) after a scenario in
    which a rank raised, died, hung or destroyed its process group. Use one per test module, as a
    module-scoped fixture, and `close()` it at the end.

    Args:
        world_size: number of ranks.
        backend: "gloo", or "nccl" (rank r on GPU r).
        grace: seconds the other ranks get to finish after one rank failed, before they are killed
            (they are usually blocked in a collective with the failed rank).
        pg_timeout: seconds before a collective of the default process group gives up (None:
            torch's default, 30 minutes): a scenario that leaves a collective unmatched on purpose
            then fails on gloo's timeout, not on the harness's.
    """

    def __init__(
        self,
        world_size: int = 2,
        *,
        backend: str = "gloo",
        grace: float = _GRACE,
        pg_timeout: float | None = None,
    ) -> None:
        self.world_size, self.backend, self.grace, self.pg_timeout = world_size, backend, grace, pg_timeout
        self.starts = 0
        """How many times the ranks were started (a restart follows every failed scenario)."""
        self._procs: list[Any] = []
        self._inboxes: list[Any] = []
        self._dir: Path | None = None
        self._store: Any = None
        self._seq = 0

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, name: str | None = None
    ) -> list:
        """Run `fn(rank, world_size, *args)` on every rank; the per-rank return values.

        Args:
            fn: module-level function.
            *args: extra positional arguments passed to every rank (picklable).
            timeout: seconds for every rank to finish the scenario (start-up not included).
            name: the scenario's name in errors; by default `fn(args)`.

        Raises:
            RankError: a rank raised, died or was killed (each failed rank's traceback or signal).
            RankTimeout: a rank was still running after `timeout` seconds (or did not start).
        """
        name = name or _scenario_name(fn, args)
        payload = pickle.dumps((fn, tuple(args)))  # an unpicklable argument fails here, not in a rank
        self._ensure_started(name)
        self._seq += 1
        seq = str(self._seq)
        for inbox in self._inboxes:
            inbox.put((seq, payload))
        try:
            return self._collect(seq, name, timeout)
        except BaseException:
            self.close()
            raise
        finally:
            if self._dir is not None and any(
                (self._dir / f"ended-{r}").exists() or p.exitcode is not None
                for r, p in enumerate(self._procs)
            ):
                self.close()

    def _ensure_started(self, name: str) -> None:
        if self._procs and all(p.is_alive() for p in self._procs):
            return
        self.close()
        ctx = _context(self.backend)
        self._dir = Path(tempfile.mkdtemp(prefix="ranks-"))
        self._inboxes = [ctx.Queue() for _ in range(self.world_size)]
        self._store = _host_store(self.world_size)
        port = self._store.port
        self._procs = [
            ctx.Process(
                target=_serve,
                args=(
                    rank,
                    self.world_size,
                    port,
                    str(self._dir),
                    self._inboxes[rank],
                    self.backend,
                    dict(os.environ),
                    self.pg_timeout,
                ),
                daemon=True,
            )
            for rank in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        self.starts += 1
        try:
            self._wait(
                lambda rank: (self._dir / f"start-{rank}.ok").exists(),
                "start",
                START_TIMEOUT,
                f"starting the ranks for scenario {name}",
            )
        except BaseException:
            self.close()
            raise

    def _collect(self, seq: str, name: str, timeout: float) -> list:
        import torch

        self._wait(lambda rank: (self._dir / f"{seq}-{rank}.pt").exists(), seq, timeout, f"scenario {name}")
        return [
            torch.load(self._dir / f"{seq}-{rank}.pt", weights_only=False) for rank in range(self.world_size)
        ]

    def _wait(self, done: Callable[[int], bool], seq: str, timeout: float, what: str) -> None:
        """Until every rank is `done`; raises as soon as a failed rank's peers had `grace` seconds."""
        deadline = time.monotonic() + timeout
        failed_at: float | None = None
        while True:
            pending = [r for r in range(self.world_size) if not done(r)]
            failed = [r for r in pending if self._failed(r, seq)]
            if not pending:
                return
            now = time.monotonic()
            if failed and failed_at is None:
                failed_at = now
            if failed_at is not None and (len(failed) == len(pending) or now - failed_at > self.grace):
                break
            if now > deadline:
                break
            time.sleep(_POLL)
        hung = [r for r in pending if r not in failed]
        self._stop()  # before reading the errors: a rank may be writing its own
        errors = self._errors(seq, failed)
        if errors:
            still = f"\n(rank(s) {hung} still running {self.grace:.0f} s later were killed)" if hung else ""
            raise RankError(f"{what} failed:\n" + "\n".join(errors) + still, self._finished(seq, pending))
        raise RankTimeout(
            f"{what} hung: rank(s) {hung} of {self.world_size} still running after {timeout:.0f} s; killed"
        )

    def _finished(self, seq: str, pending: list[int]) -> dict[int, Any]:
        import torch

        if seq == "start":
            return {}
        done = [r for r in range(self.world_size) if r not in pending]
        return {r: torch.load(self._dir / f"{seq}-{r}.pt", weights_only=False) for r in done}

    def _failed(self, rank: int, seq: str) -> bool:
        return (self._dir / f"{seq}-{rank}.err").exists() or self._procs[rank].exitcode is not None

    def _errors(self, seq: str, failed: list[int]) -> list[str]:
        errors = []
        for rank in failed:
            err = self._dir / f"{seq}-{rank}.err"
            if err.exists():
                errors.append(f"--- rank {rank} raised:\n{err.read_text()}")
            else:
                errors.append(f"--- rank {rank} {_how_it_ended(self._procs[rank].exitcode)}")
        return errors

    def _stop(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join()

    def close(self) -> None:
        """Stop the ranks (asking first: a rank between scenarios exits on its own)."""
        if self._procs and all(p.is_alive() for p in self._procs):
            for inbox in self._inboxes:
                with contextlib.suppress(Exception):
                    inbox.put(None)
            deadline = time.monotonic() + 10
            while any(p.is_alive() for p in self._procs) and time.monotonic() < deadline:
                time.sleep(_POLL)
        self._stop()
        for inbox in self._inboxes:
            inbox.close()
            inbox.cancel_join_thread()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._procs, self._inboxes, self._dir, self._store = [], [], None, None


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    timeout: float = 120.0,
    args: tuple | list = (),
    grace: float = _GRACE,
    backend: str = "gloo",
    pg_timeout: float | None = None,
) -> list[Any]:
    """Run one scenario `fn(rank, world_size, *args)` on fresh ranks, then stop them.

    For scenarios that end a rank or its process group on purpose; `RankPool.run` for the rest.
    Same arguments, return value and errors as `RankPool.run`.
    """
    pool = RankPool(world_size, backend=backend, grace=grace, pg_timeout=pg_timeout)
    try:
        return pool.run(fn, *args, timeout=timeout)
    finally:
        pool.close()


def _script_rank(rank: int, world_size: int, port: int, module: str, argv: list, out: str, env: dict) -> None:
    """A forked rank of `run_script`: torchrun's environment, its output appended to `out`,
    `main(argv)`'s status (or its SystemExit's) as the exit status."""
    import importlib
    import sys

    os.environ.clear()
    os.environ.update(env)
    ranks = {"RANK": rank, "WORLD_SIZE": world_size, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": world_size}
    os.environ.update({k: str(v) for k, v in ranks.items()}, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():  # what torch read at import under torchrun
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    try:
        status = importlib.import_module(module).main(argv)
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status or 0)  # as the script's own end would, without waiting on peers at teardown


def run_script(
    module: str,
    argv: list[str],
    world_size: int = 2,
    *,
    timeout: float = 120.0,
    env: dict | None = None,
    restarts: int = 0,
) -> list[tuple[int | None, str]]:
    """`module.main(argv)` on `world_size` ranks forked from the session's server, in the environment
    torchrun gives its workers (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT,
    and its agent's store, hosted here, which outlives any rank and every attempt): per rank, the
    exit status of its last attempt and its output of every attempt.

    `restarts`: as torchrun's `--max-restarts`: when a rank fails, the others are stopped (SIGTERM,
    then SIGKILL 5 s later) and every rank starts again with TORCHELASTIC_RESTART_COUNT one higher,
    at most `restarts` times. For a script's paths that end a rank (bad input, an error exit, a rank
    killed and resumed) on ranks that start in a second, where a torchrun launch imports torch again
    on every worker; one torchrun test per entry point keeps the launcher itself covered. A rank
    still running after `timeout` seconds (all attempts together) is killed and shows as status None.
    """
    from multiprocessing.connection import wait

    ctx = _context()
    store = _host_store(world_size)  # as torchrun's agent: a rank that ends leaves it to its peers
    outs = Path(tempfile.mkdtemp(prefix="script-"))
    base = {k: v for k, v in {**os.environ, **(env or {})}.items() if not k.startswith("TORCHELASTIC")}
    deadline = time.monotonic() + timeout
    try:
        for attempt in range(restarts + 1):
            base.update(TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT=str(attempt))
            procs = [
                ctx.Process(
                    target=_script_rank,
                    args=(r, world_size, store.port, module, list(argv), str(outs / f"rank{r}"), base),
                )
                for r in range(world_size)
            ]
            for p in procs:
                p.start()
            restart = attempt < restarts  # else the ranks end on their own, as before any restart
            while (running := [p for p in procs if p.exitcode is None]) and time.monotonic() < deadline:
                if restart and any(p.exitcode for p in procs):
                    break
                wait([p.sentinel for p in running], max(0.0, deadline - time.monotonic()))
            failed = any(p.exitcode for p in procs)
            late = [p.exitcode is None and not (restart and failed) for p in procs]
            for p, was_late in zip(procs, late, strict=True):
                if p.exitcode is None and not was_late:
                    p.terminate()  # a failed rank's peers, stopped as torchrun's agent stops them
                    p.join(5.0)
                if p.exitcode is None:
                    p.kill()
                p.join()
            statuses = [None if was_late else p.exitcode for p, was_late in zip(procs, late, strict=True)]
            if not (restart and failed) or time.monotonic() >= deadline:
                break
        return [(status, (outs / f"rank{r}").read_text()) for r, status in enumerate(statuses)]
    finally:
        shutil.rmtree(outs, ignore_errors=True)
        del store


def script_job(ranks: list[tuple[int | None, str]]) -> Any:
    """`run_script`'s ranks as one job, a `subprocess.CompletedProcess`: the status of the first rank
    that failed (1 for one killed at the timeout) or 0, and every rank's output, in rank order, as
    its stderr."""
    import subprocess

    failed = next((status for status, _ in ranks if status != 0), 0)
    return subprocess.CompletedProcess(
        [], 1 if failed is None else failed, "", "".join(out for _, out in ranks)
    )
