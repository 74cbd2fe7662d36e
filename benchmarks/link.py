"""Emulate a network link between two local ranks: a network namespace per rank, joined by a veth pair
whose two ends are each rate-limited with `tc tbf` (a full-duplex link of that rate).

`emulated_link("1gbit")` creates namespaces `trbench-<pid>-0/1` with 10.77.0.1/24 and 10.77.0.2/24 on
the veth ends, yields a `Link` (how to start a rank inside its namespace, which interface gloo uses),
and deletes everything it created on exit: normal, exception, Ctrl-C, SIGTERM or SIGHUP. Namespaces of
an earlier run killed with SIGKILL are removed at the next start. Needs root and iproute2 (`ip`, `tc`).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["Link", "LinkUnavailable", "check_available", "emulated_link", "parse_rate", "signals_raise"]

_PREFIX = "trbench"
_SUBNET = "10.77.0"
_STALE = re.compile(rf"^{_PREFIX}-(\d+)-\d+\b")
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12, "bps": 8, "kbps": 8e3, "mbps": 8e6}
_UNITS |= {"gbps": 8e9, "tbps": 8e12, "kibit": 2**10, "mibit": 2**20, "gibit": 2**30, "tibit": 2**40}

Runner = Callable[[Sequence[str]], str]


class LinkUnavailable(RuntimeError):
    """Link emulation cannot run here; the message says why and what to do instead."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Link:
    """A live emulated link between rank 0 and rank 1."""

    rate: str
    """The tc rate of each direction, e.g. `1gbit`."""
    namespaces: tuple[str, str]
    interfaces: tuple[str, str]
    """The veth end inside each rank's namespace."""
    addresses: tuple[str, str]

    def command(self, rank: int, argv: Sequence[str]) -> list[str]:
        """`argv` run inside rank `rank`'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[rank], *argv]

    def env(self, rank: int) -> dict[str, str]:
        """Environment for rank `rank`: gloo on the veth, the store on rank 0's veth address."""
        return {"GLOO_SOCKET_IFNAME": self.interfaces[rank], "MASTER_ADDR": self.addresses[0]}


def parse_rate(rate: str) -> float:
    """Bits per second of a tc rate such as `1gbit`, `100mbit` or `125mbps` (bytes).

    Raises:
        ValueError: not a tc rate.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", rate)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"not a tc rate: {rate!r}; write e.g. 1gbit, 100mbit or 125mbps")
    return float(match.group(1)) * _UNITS[unit]


def check_available(
    *, which: Callable[[str], str | None] | None = None, euid: Callable[[], int] | None = None
) -> None:
    """Raise `LinkUnavailable` (not root, or `ip`/`tc` missing) unless this process can create
    namespaces, veths and qdiscs; `which` and `euid` default to `shutil.which` and `os.geteuid`."""
    hint = "or run without --link to benchmark over loopback (make bench BENCH_ARGS=)"
    if (euid or os.geteuid)() != 0:
        raise LinkUnavailable(
            f"--link needs root (network namespaces, veth and tc qdiscs): run as root, {hint}"
        )
    missing = [tool for tool in ("ip", "tc") if (which or shutil.which)(tool) is None]
    if missing:
        raise LinkUnavailable(
            f"--link needs {' and '.join(missing)} from iproute2: apt-get install iproute2, {hint}"
        )


def _run(argv: Sequence[str]) -> str:
    done = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    if done.returncode:
        raise LinkUnavailable(f"`{' '.join(argv)}` failed: {done.stderr.strip() or done.returncode}")
    return done.stdout


@contextmanager
def emulated_link(
    rate: str, *, run: Runner = _run, check: Callable[[], None] = check_available
) -> Iterator[Link]:
    """Create the namespaces, veth pair and rate limits; remove them all on exit.

    Args:
        rate: tc rate of each direction, e.g. `1gbit`.
        run: runs one command and returns its stdout, raising on failure (tests pass a fake).
        check: raises `LinkUnavailable` when emulation cannot run (tests pass a fake).

    Raises:
        LinkUnavailable: not root, iproute2 missing, or a setup command failed (after cleaning up).
        ValueError: `rate` is not a tc rate.
    """
    bits = parse_rate(rate)
    check()
    pid = os.getpid()
    link = Link(
        rate=rate,
        namespaces=(f"{_PREFIX}-{pid}-0", f"{_PREFIX}-{pid}-1"),
        interfaces=(f"tbv{pid}r0", f"tbv{pid}r1"),
        addresses=(f"{_SUBNET}.1", f"{_SUBNET}.2"),
    )
    _remove_stale(run)
    with signals_raise():
        try:
            _create(link, bits, run)
            yield link
        finally:
            leftovers = _teardown(link, run)
            if leftovers:  # warn rather than raise: an exception may already be on its way out
                print(f"link: could not remove {', '.join(leftovers)}; delete by hand", file=sys.stderr)


def _create(link: Link, bits: float, run: Runner) -> None:
    # 1 ms of traffic per burst, at least a few full frames (a burst under one frame drops it).
    burst = max(int(bits / 8 / 1000), 16 * 1024)
    for ns in link.namespaces:
        run(["ip", "netns", "add", ns])
    run(["ip", "link", "add", link.interfaces[0], "type", "veth", "peer", "name", link.interfaces[1]])
    for ns, dev, addr in zip(link.namespaces, link.interfaces, link.addresses, strict=True):
        run(["ip", "link", "set", dev, "netns", ns])
        run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev])
        run(["ip", "-n", ns, "link", "set", dev, "up"])
        run(["ip", "-n", ns, "link", "set", "lo", "up"])
        tbf = ["tbf", "rate", link.rate, "burst", str(burst), "latency", "200ms"]
        run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *tbf])


def _teardown(link: Link, run: Runner) -> list[str]:
    """Delete what `_create` made, whatever stage it reached; returns what could not be removed."""
    # A second Ctrl-C must not cut the cleanup short: hold signals until it is done.
    held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        existing = _namespaces(run)
        leftovers = []
        for ns in link.namespaces:
            if ns in existing:
                try:
                    run(["ip", "netns", "del", ns])
                except LinkUnavailable:
                    leftovers.append(f"namespace {ns}")
        for dev in link.interfaces:  # only still here if it was never moved into a namespace
            if _has_link(dev, run):
                try:
                    run(["ip", "link", "del", dev])
                except LinkUnavailable:
                    leftovers.append(f"interface {dev}")
        return leftovers
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, held)


def _namespaces(run: Runner) -> set[str]:
    try:
        return {line.split()[0] for line in run(["ip", "netns", "list"]).splitlines() if line.strip()}
    except LinkUnavailable:
        return set()


def _has_link(dev: str, run: Runner) -> bool:
    try:
        run(["ip", "link", "show", dev])
    except LinkUnavailable:
        return False
    return True


def _remove_stale(run: Runner) -> None:
    """Delete namespaces left by an earlier run whose process no longer exists (SIGKILL)."""
    for ns in sorted(_namespaces(run)):
        match = _STALE.match(ns)
        if match and not _alive(int(match.group(1))):
            run(["ip", "netns", "del", ns])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        pass
    return True


@contextmanager
def signals_raise() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into SystemExit (SIGINT already raises), so `finally` runs."""

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    sigs = (signal.SIGTERM, signal.SIGHUP)
    try:
        previous = {s: signal.signal(s, handler) for s in sigs}
    except ValueError:  # not the main thread: leave signals alone
        previous = {}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
