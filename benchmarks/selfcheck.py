"""`python -m benchmarks selfcheck`: the benchmarks' own pure parts, checked against fakes in a second.

The arithmetic every report rests on (paired ratios, the profiled wait in forward, the bound's
distance, the order of rounds, the variant names, one warm-up per config) and the emulated link's
setup and cleanup against a fake `ip`/`tc` (no root, nothing created). These live here rather than
in tests/ so that the tests never import the benchmarks: tests/test_bench.py runs this command and
reads which checks passed. Each check raises AssertionError (or any error) on failure; the command
prints one line per check.
"""

from __future__ import annotations

import json as json_module
import os
import signal
import traceback
from collections.abc import Callable, Sequence
from contextlib import suppress
from pathlib import Path
from types import FunctionType, SimpleNamespace

from benchmarks.link import LinkUnavailable, check_available, emulated_link, parse_rate
from benchmarks.report import paired, paired_difference
from benchmarks.spec import VARIANTS, RunSpec, parse_variant, reference, round_order

__all__ = ["CHECKS", "selfcheck"]


class _FakeIp:
    """Just enough of `ip`/`tc`: namespaces, and which namespace each interface is in."""

    def __init__(self, fail_on: str | None = None, namespaces: Sequence[str] = ()) -> None:
        self.fail_on, self.namespaces, self.calls = fail_on, set(namespaces), []
        self.links: dict[str, str | None] = {}  # interface -> namespace (None: the root one)

    def __call__(self, argv: Sequence[str]) -> str:
        argv = list(argv)
        self.calls.append(argv)
        if self.fail_on and self.fail_on in " ".join(argv):
            raise LinkUnavailable(f"`{' '.join(argv)}` failed: fake failure")
        match argv:
            case ["ip", "netns", "add", ns]:
                self.namespaces.add(ns)
            case ["ip", "netns", "del", ns]:
                self.namespaces.discard(ns)
                self.links = {d: n for d, n in self.links.items() if n != ns}
            case ["ip", "netns", "list"]:
                return "".join(f"{ns} (id: {i})\n" for i, ns in enumerate(sorted(self.namespaces)))
            case ["ip", "link", "add", a, "type", "veth", "peer", "name", b]:
                self.links.update({a: None, b: None})
            case ["ip", "link", "set", dev, "netns", ns]:
                self.links[dev] = ns
            case ["ip", "link", "show", dev] if self.links.get(dev, "absent") is not None:
                raise LinkUnavailable(f"Device {dev} does not exist")
            case ["ip", "link", "del", _]:
                self.links.clear()  # deleting one end of a veth deletes the pair
        return ""

    @property
    def clean(self) -> bool:
        return not any(ns.startswith("trbench-") for ns in self.namespaces) and not self.links


def _ok() -> None:
    pass


def link_rates() -> None:
    assert parse_rate("1gbit") == 1e9 and parse_rate("100mbit") == 1e8 and parse_rate("1.5Gbit") == 1.5e9
    assert parse_rate("125mbps") == 1e9  # bytes
    for bad in ("fast", "1 gigabit", "0mbit", "-1gbit", ""):
        with suppress(ValueError):
            parse_rate(bad)
            raise AssertionError(f"{bad!r} was taken for a rate")


def link_setup_and_cleanup() -> None:
    ip = _FakeIp()
    with emulated_link("1gbit", run=ip, check=_ok) as link:
        assert ip.links == {link.interfaces[0]: link.namespaces[0], link.interfaces[1]: link.namespaces[1]}
        tbf = [c for c in ip.calls if c[0] == "tc"]
        assert len(tbf) == 2 and all("tbf" in c and "1gbit" in c for c in tbf), tbf
        assert link.env(1) == {"GLOO_SOCKET_IFNAME": link.interfaces[1], "MASTER_ADDR": "10.77.0.1"}
        assert link.command(0, ["python"])[:4] == ["ip", "netns", "exec", link.namespaces[0]]
    assert ip.clean, ip.namespaces


def link_cleanup_when_setup_fails() -> None:
    for step in ("netns add", "type veth", "r1 netns", "tc -n"):
        ip = _FakeIp(fail_on=step)
        with suppress(LinkUnavailable), emulated_link("100mbit", run=ip, check=_ok):
            raise AssertionError(f"the body ran although {step!r} failed")
        assert ip.clean, f"left behind after {step!r} failed: {ip.namespaces} {ip.links}"


def link_cleanup_on_ctrl_c_and_sigterm() -> None:
    ip = _FakeIp()
    with suppress(KeyboardInterrupt), emulated_link("1gbit", run=ip, check=_ok):
        raise KeyboardInterrupt
    assert ip.clean, "after Ctrl-C"
    before = signal.getsignal(signal.SIGTERM)
    try:
        with emulated_link("1gbit", run=ip, check=_ok):
            os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not stop the body")
    except SystemExit as e:
        assert e.code == 128 + signal.SIGTERM, e.code
    assert ip.clean and signal.getsignal(signal.SIGTERM) is before, "after SIGTERM"


def link_removes_only_dead_runs() -> None:
    alive = f"trbench-{os.getppid()}-0"  # a live process, not this one
    ip = _FakeIp(namespaces=["trbench-999999999-0", alive, "other"])
    with emulated_link("1gbit", run=ip, check=_ok):
        pass
    assert ip.namespaces == {alive, "other"}, ip.namespaces


def link_says_why_it_cannot_run() -> None:
    no_tc = lambda tool: None if tool == "tc" else "/sbin/ip"  # noqa: E731
    for euid, which, words in ((lambda: 1000, None, "needs root"), (lambda: 0, no_tc, "apt-get install")):
        try:
            check_available(euid=euid, which=which)
            raise AssertionError(f"no {words!r}")
        except LinkUnavailable as e:
            assert words in str(e), e
    ip = _FakeIp()
    with (
        suppress(LinkUnavailable),
        emulated_link("1gbit", run=ip, check=lambda: check_available(euid=lambda: 1000)),
    ):
        raise AssertionError("the body ran without root")
    assert ip.calls == [], "something was attempted"


def paired_arithmetic() -> None:
    rounds = {0: {"a": 90.0, "b": 100.0}, 1: {"a": 60.0, "b": 50.0}, 2: {"a": 40.0, "b": 50.0}, 3: {"b": 9.0}}
    ratio, difference = paired(rounds, "a", "b"), paired_difference(rounds, "a", "b")
    assert ratio is not None and (ratio.median, ratio.low, ratio.high, ratio.rounds) == (0.9, 0.8, 1.2, 3), (
        ratio
    )
    assert difference is not None and (difference.median, difference.low, difference.high) == (-10, -10, 10)
    assert f"{ratio:.2f}" == "0.90 [0.80, 1.20]" and paired(rounds, "a", "c") is None


def _event(name: str, start: float, end: float, thread: int = 1) -> SimpleNamespace:
    return SimpleNamespace(name=name, thread=thread, time_range=SimpleNamespace(start=start, end=end))


def wait_in_forward() -> None:
    from benchmarks.measure import summarize_profile

    recat = "## dist_init:recat_values ##"
    events = [
        _event("pipeline::forward#0", 0, 10_000),
        _event("pipeline::input_dist::wait#0", 1_000, 4_000),  # inside forward: counts
        _event(recat, 2_000, 3_000),  # inside a counted wait: counts as assembly
        _event(recat, 5_000, 6_000),  # in forward, outside the wait: not
        _event("pipeline::input_dist::wait#1", 12_000, 15_000),  # after forward: not
        _event("pipeline::input_dist::wait#0", 2_000, 9_000, thread=2),  # another thread: not
        _event("aten::mm", 1_000, 2_000),
    ]
    s = summarize_profile(
        events, forward_label="pipeline::forward", wait_label="pipeline::input_dist::wait", steps=2
    )
    assert (s.wait_in_forward_ms, s.assembly_in_wait_ms, s.forward_ms) == (1.5, 0.5, 5.0), s
    assert s.labels_ms["pipeline::input_dist::wait"] == 3.0 and "aten::mm" not in s.labels_ms, s.labels_ms


def tiered_distance() -> None:
    from benchmarks.tiered import distance

    got = distance(
        {0: {"io-alone": 60.0, "compute-alone": 75.0}, 1: {"io-alone": 80.0, "compute-alone": 40.0}}
    )
    assert [r["bound"] for r in got.values()] == [75.0, 80.0], got


def rounds_and_variants() -> None:
    orders = [round_order(VARIANTS, r) for r in range(3)]
    assert all(sorted(o) == sorted(VARIANTS) for o in orders) and len({o[0] for o in orders}) == 3, orders
    assert parse_variant("ours-sparse-dist@late+novote") == ("ours-sparse-dist", "late", ("novote",))
    assert parse_variant("ours-prefetch+inline") == ("ours-prefetch", None, ("inline",))
    assert reference("ours-sparse-dist@late+novote") == "ours-sparse-dist@late"
    assert reference("ours-eval") == "torchrec-eval" and reference("plain") is None
    assert reference("ours-sparse-dist@adaptive") == "ours-sparse-dist", "the default, named"
    for bad in ("fast", "torchrec-base+novote", "ours-base@early", "ours-base+nope", "ours-sparse-dist@auto"):
        with suppress(ValueError):
            parse_variant(bad)
            raise AssertionError(f"{bad!r} was taken for a variant")


def one_warmup_per_config() -> None:
    """Every variant of a config times the same steps: the longer warm-up for all of them where one
    measures before it decides (Prefetch's watch, with tables on disk), else the short one."""

    def spec(*variants: str) -> RunSpec:
        return RunSpec(configs=("demo", "tiered"), variants=variants, warmup=20, auto_warmup=90)

    every = spec("plain", "ours-sparse-dist", "ours-prefetch", "torchrec-sparse-dist")
    assert (every.warmup_of("demo"), every.warmup_of("tiered")) == (20, 90)
    forced = spec("plain", "ours-prefetch+inline", "ours-sparse-dist@early")
    assert (forced.warmup_of("demo"), forced.warmup_of("tiered")) == (20, 20)
    gpu = RunSpec(
        configs=("gpu-uvm",), variants=("plain", "ours-prefetch"), warmup=20, auto_warmup=90, device="cuda"
    )
    assert gpu.warmup_of("gpu-uvm") == 20, "on CUDA, Prefetch behind the UVM cache runs no watch"


def riding_reads_its_stand_in_as_the_pipeline_does() -> None:
    """`python -m benchmarks riding`'s received status row is read by the real `read_statuses`."""
    from benchmarks.riding import _one

    assert _one(8, True, 3) > 0 and _one(8, False, 3) > 0


CHECKS: dict[str, Callable[[], None]] = {
    n: f
    for n, f in list(globals().items())
    if isinstance(f, FunctionType) and f.__module__ == __name__ and n[0] != "_"
}
"""Every public function above, in the order written."""


def selfcheck(*, json: str | None, command: str) -> int:
    """Run every check; print `ok NAME` or `FAILED NAME` with the error; 1 if any failed."""
    outcome = {}
    for name, check in CHECKS.items():
        try:
            check()
            outcome[name] = "ok"
        except Exception:  # a failed check is reported, the others still run
            outcome[name] = traceback.format_exc(limit=3)
        print(f"ok     {name}" if outcome[name] == "ok" else f"FAILED {name}\n{outcome[name]}")
    if json:
        Path(json).write_text(json_module.dumps(outcome, indent=1))
    return 0 if all(v == "ok" for v in outcome.values()) else 1
