"""The benchmark machinery: a tiny end-to-end run on 2 ranks, and link emulation's setup, cleanup and
"cannot run" paths against a fake `ip`/`tc` (no root needed)."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Sequence
from types import SimpleNamespace

import pytest

from benchmarks import link as link_mod
from benchmarks.configs import CONFIGS
from benchmarks.link import LinkUnavailable, check_available, emulated_link, parse_rate
from benchmarks.measure import summarize_profile
from benchmarks.run import main
from benchmarks.spec import CPU_UNSUPPORTED, FAMILY_VARIANTS, VARIANTS, RunSpec, round_order
from benchmarks.tiered_report import BALANCED_CONFIG, distance


def test_tiny_run_reports_every_variant(tmp_path):
    out = tmp_path / "r.json"
    argv = ["--configs", "demo", "--steps", "3", "--warmup", "2", "--rounds", "1", "--profile-steps", "2"]
    assert main([*argv, "--json", str(out), "--md", str(tmp_path / "r.md")]) == 0
    result = json.loads(out.read_text())
    rows = {r["variant"]: r for r in result["summary"]}
    assert set(rows) == set(VARIANTS)
    for variant, row in rows.items():
        if variant == "torchrec-prefetch" and row["status"] != "ok":
            assert "does not run on CPU" in row["message"]
            continue
        assert row["status"] == "ok", row
        assert row["median_step_ms"] > 0 and row["samples_per_s"] > 0
        assert row["wait_in_forward_ms"] is not None and row["assembly_in_wait_ms"] is not None
    assert rows["plain"]["vs_plain"] == pytest.approx(1.0)
    assert rows["ours-sparse-dist"]["schedule"] and rows["plain"]["schedule"] is None
    assert rows["plain"]["wait_in_forward_ms"] > 0  # the inline input_dist was measured
    runs = [r for r in result["runs"] if r["status"] == "ok"]
    assert all(len(r["step_times_s"]) == 3 and min(r["step_times_s"]) > 0 for r in runs)
    assert (tmp_path / "r.md").read_text().startswith("# Benchmark results")


def test_tiny_run_of_the_family(tmp_path):
    out = tmp_path / "r.json"
    argv = ["--configs", "demo", "--steps", "3", "--warmup", "2", "--auto-warmup", "2", "--rounds", "1"]
    argv += ["--profile-steps", "2", "--variants", *FAMILY_VARIANTS]
    assert main([*argv, "--json", str(out), "--md", str(tmp_path / "r.md")]) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["summary"]}
    assert set(rows) == set(FAMILY_VARIANTS)
    for variant, row in rows.items():
        if variant in CPU_UNSUPPORTED:  # torchrec 1.8's Fused and SemiSync fail on CPU
            assert row["status"] != "ok" and "does not run on CPU" in row["message"], row
            continue
        assert row["status"] == "ok", row
        assert row["median_step_ms"] > 0 and row["samples_per_s"] > 0
    assert rows["ours-eval"]["vs_torchrec"] is not None


def test_tables_on_disk_against_their_bound_at_one_rank(tmp_path, monkeypatch):
    """At world size 1, io-alone and compute-alone run beside Prefetch, and the report
    gives Prefetch's distance to max(io-alone, compute-alone) and every run's process CPU time."""
    monkeypatch.setenv("BENCH_STORE_DIR", str(tmp_path / "stores"))
    out = tmp_path / "r.json"
    argv = ["--world-size", "1", "--configs", "tiered-tiny", "--steps", "3", "--warmup", "3"]
    argv += ["--auto-warmup", "3", "--rounds", "1", "--profile-steps", "0"]
    argv += ["--variants", "plain", "ours-prefetch", "io-alone", "compute-alone"]
    assert main([*argv, "--json", str(out), "--md", str(tmp_path / "r.md")]) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["summary"]}
    assert all(r["status"] == "ok" and r["cpu_ms"] > 0 for r in rows.values()), rows
    assert rows["compute-alone"]["cache_hit_rate"] == 1.0  # every row cached: no step reads the disk
    assert rows["io-alone"]["store_read_ms"] > 0 and rows["io-alone"]["cache_hit_rate"] < 0.5
    bound = max(rows["io-alone"]["median_step_ms"], rows["compute-alone"]["median_step_ms"])
    line = f"Prefetch step / bound: {rows['ours-prefetch']['median_step_ms'] / bound:.3f}"
    assert line in (tmp_path / "r.md").read_text()


def test_distance_is_prefetch_over_the_larger_half():
    assert distance(90.0, 60.0, 75.0) == pytest.approx(1.2)
    assert distance(90.0, 80.0, 40.0) == pytest.approx(1.125)
    assert distance(90.0, None, 40.0) is None
    assert BALANCED_CONFIG in CONFIGS and CONFIGS[BALANCED_CONFIG].cache_fraction is not None


def _event(name: str, start: float, end: float, thread: int = 1) -> SimpleNamespace:
    return SimpleNamespace(name=name, thread=thread, time_range=SimpleNamespace(start=start, end=end))


def test_wait_counts_only_inside_forward_on_its_thread():
    events = [
        _event("pipeline::forward#0", 0, 10_000),
        _event("pipeline::input_dist::wait#0", 1_000, 3_000),  # inside forward: counts
        _event("pipeline::input_dist::wait#1", 12_000, 15_000),  # after forward (prefetch): not
        _event("pipeline::input_dist::wait#0", 2_000, 9_000, thread=2),  # another thread: not
        _event("pipeline::forward#1", 20_000, 30_000),
        _event("pipeline::input_dist::wait#1", 29_000, 30_000),
        _event("aten::mm", 1_000, 2_000),
    ]
    summary = summarize_profile(
        events, forward_label="pipeline::forward", wait_label="pipeline::input_dist::wait", steps=2
    )
    assert summary.wait_in_forward_ms == pytest.approx(1.5)  # (2 ms + 1 ms) / 2 steps
    assert summary.forward_ms == pytest.approx(10.0)
    assert summary.labels_ms["pipeline::input_dist::wait"] == pytest.approx(3.0)  # all of thread 1
    assert "aten::mm" not in summary.labels_ms
    assert summary.assembly_in_wait_ms == 0.0


def test_assembly_counts_only_inside_counted_waits():
    recat = "## dist_init:recat_values ##"
    events = [
        _event("pipeline::forward#0", 0, 10_000),
        _event("pipeline::input_dist::wait#0", 1_000, 4_000),
        _event(recat, 2_000, 3_000),  # inside a counted wait: counts
        _event(recat, 5_000, 6_000),  # in forward, outside the wait: not
        _event("pipeline::input_dist::wait#1", 12_000, 15_000),  # outside forward
        _event(recat, 13_000, 14_000),  # so this one does not count either
    ]
    summary = summarize_profile(
        events, forward_label="pipeline::forward", wait_label="pipeline::input_dist::wait", steps=1
    )
    assert summary.wait_in_forward_ms == pytest.approx(3.0)
    assert summary.assembly_in_wait_ms == pytest.approx(1.0)


def test_rounds_rotate_the_order():
    orders = [round_order(VARIANTS, r) for r in range(3)]
    assert all(sorted(o) == sorted(VARIANTS) for o in orders)
    assert len({o[0] for o in orders}) == 3


def test_spec_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown config"):
        RunSpec(configs=("nope",))
    with pytest.raises(ValueError, match="unknown variants"):
        RunSpec(configs=("demo",), variants=("fast",))


# -- link emulation, against a fake `ip` -------------------------------------------------------


class FakeIp:
    """Just enough of `ip`/`tc` state: namespaces, and which namespace each interface is in."""

    def __init__(self, fail_on: str | None = None, namespaces: Sequence[str] = ()) -> None:
        self.fail_on = fail_on
        self.namespaces = set(namespaces)
        self.links: dict[str, str | None] = {}  # interface -> namespace (None: root)
        self.calls: list[list[str]] = []

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
            case ["ip", "link", "del", dev]:
                self.links.clear()  # deleting one end of a veth deletes the pair
        return ""

    @property
    def clean(self) -> bool:
        return not any(ns.startswith("trbench-") for ns in self.namespaces) and not self.links


def _ok() -> None:
    pass


def test_link_creates_and_removes_everything():
    ip = FakeIp()
    with emulated_link("1gbit", run=ip, check=_ok) as link:
        assert set(link.namespaces) <= ip.namespaces
        assert ip.links == {link.interfaces[0]: link.namespaces[0], link.interfaces[1]: link.namespaces[1]}
        tbf = [c for c in ip.calls if c[0] == "tc"]
        assert len(tbf) == 2 and all("tbf" in c and "1gbit" in c for c in tbf)
        assert link.env(1) == {"GLOO_SOCKET_IFNAME": link.interfaces[1], "MASTER_ADDR": "10.77.0.1"}
        assert link.command(0, ["python"])[:4] == ["ip", "netns", "exec", link.namespaces[0]]
    assert ip.clean


@pytest.mark.parametrize("step", ["netns add", "type veth", "r1 netns", "tc -n"])
def test_link_cleans_up_when_setup_fails(step):
    ip = FakeIp(fail_on=step)
    with pytest.raises(LinkUnavailable, match="fake failure"):
        with emulated_link("100mbit", run=ip, check=_ok):
            pytest.fail("the body must not run")
    assert ip.clean


def test_link_cleans_up_on_ctrl_c_and_sigterm():
    ip = FakeIp()
    with pytest.raises(KeyboardInterrupt):
        with emulated_link("1gbit", run=ip, check=_ok):
            raise KeyboardInterrupt
    assert ip.clean
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as info:
        with emulated_link("1gbit", run=ip, check=_ok):
            os.kill(os.getpid(), signal.SIGTERM)
    assert info.value.code == 128 + signal.SIGTERM
    assert ip.clean
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is put back


def test_link_removes_namespaces_of_dead_runs_only():
    alive = f"trbench-{os.getppid()}-0"  # a live process, not this one
    ip = FakeIp(namespaces=["trbench-999999999-0", alive, "other"])
    with emulated_link("1gbit", run=ip, check=_ok):
        pass
    assert ip.namespaces == {alive, "other"}


def test_link_says_why_it_cannot_run(monkeypatch):
    with pytest.raises(LinkUnavailable, match="needs root"):
        check_available(euid=lambda: 1000)
    with pytest.raises(LinkUnavailable, match=r"needs tc from iproute2.*apt-get install iproute2"):
        check_available(euid=lambda: 0, which=lambda tool: None if tool == "tc" else "/usr/sbin/ip")
    ip = FakeIp()
    with pytest.raises(LinkUnavailable, match="needs root"):
        with emulated_link("1gbit", run=ip, check=lambda: check_available(euid=lambda: 1000)):
            pass
    assert ip.calls == []  # nothing was attempted
    # The CLI turns it into one message and exit status 2, before starting any rank.
    monkeypatch.setattr(link_mod.os, "geteuid", lambda: 1000)
    assert main(["--configs", "demo", "--link", "1gbit"]) == 2


def test_parse_rate():
    assert parse_rate("1gbit") == 1e9
    assert parse_rate("100mbit") == 1e8
    assert parse_rate("125mbps") == 1e9
    assert parse_rate("1.5Gbit") == 1.5e9
    for bad in ("fast", "1 gigabit", "0mbit", "-1gbit", ""):
        with pytest.raises(ValueError, match="not a tc rate"):
            parse_rate(bad)
