"""The benchmark CLI, run as a user runs it (`python -m benchmarks ...` in a subprocess), its JSON read.

The tests never import `benchmarks`: the pure parts (paired ratios, the profiled wait in forward, the
variant names, the emulated link's setup and cleanup against a fake `ip`) are checked by
`python -m benchmarks selfcheck`, one test per check; the rest is tiny end-to-end runs (2 steps) whose
JSON is checked for what each suite promises, and the report's arithmetic is recomputed from the raw
runs it wrote.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the benchmarks' smoke runs: subprocess interpreters and rank launches

ROOT = Path(__file__).resolve().parent.parent
SELFCHECKS = (
    "link_rates",
    "link_setup_and_cleanup",
    "link_cleanup_when_setup_fails",
    "link_cleanup_on_ctrl_c_and_sigterm",
    "link_removes_only_dead_runs",
    "link_says_why_it_cannot_run",
    "paired_arithmetic",
    "wait_in_forward",
    "tiered_distance",
    "rounds_and_variants",
    "one_warmup_per_config",
    "riding_reads_its_stand_in_as_the_pipeline_does",
)
TINY = ["--steps", "2", "--warmup", "2", "--rounds", "1"]


def bench(*argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """`python -m benchmarks ARGV` from the repository's root; its output captured."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def selfcheck(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("selfcheck") / "checks.json"
    done = bench("selfcheck", "--json", str(out), timeout=60)
    assert out.exists(), f"selfcheck wrote nothing:\n{done.stdout}\n{done.stderr}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("check", SELFCHECKS)
def test_selfcheck(selfcheck: dict[str, str], check: str) -> None:
    assert check in selfcheck, f"selfcheck has no check {check}: {sorted(selfcheck)}"
    assert selfcheck[check] == "ok", f"selfcheck {check} failed:\n{selfcheck[check]}"


def test_bad_input_stops_before_any_rank_with_a_message() -> None:
    cases = {
        "a link rate that is not one": (["--link", "fast"], "not a tc rate"),
        "an unknown variant": (["--variants", "plain", "ours-base@early"], "unknown variant"),
        "an unknown config": (["--configs", "nope"], "unknown config"),
        "a link between 3 ranks": (["--link", "1gbit", "--world-size", "3"], "exactly 2 ranks"),
    }
    for scenario, (argv, words) in cases.items():
        done = bench("run", "--configs", "tiny", *argv, "--json", "", "--md", "", timeout=60)
        assert done.returncode == 2 and words in done.stderr, f"{scenario}: {done.returncode} {done.stderr}"
        assert "[bench]" not in done.stdout, f"{scenario}: a rank ran"


@pytest.mark.slow
def test_a_tiny_run_reports_paired_figures_from_its_rounds(tmp_path: Path) -> None:
    variants = ["plain", "ours-base", "ours-sparse-dist", "torchrec-sparse-dist", "torchrec-prefetch"]
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    done = bench(
        "run",
        "--configs",
        "tiny",
        "--variants",
        *variants,
        "--steps",
        "3",
        "--warmup",
        "2",
        "--auto-warmup",
        "2",
        "--rounds",
        "2",
        "--profile-steps",
        "2",
        "--json",
        str(out),
        "--md",
        str(md),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {r["variant"]: r for r in result["summary"]}
    assert list(rows) == variants, f"the summary's rows: {list(rows)}"
    assert rows["torchrec-prefetch"]["status"] == "unsupported", rows["torchrec-prefetch"]
    assert "does not run on CPU" in rows["torchrec-prefetch"]["message"]
    per_round: dict[int, dict[str, float]] = {}
    for run in result["runs"]:
        if run["status"] == "ok":
            assert len(run["step_times_s"]) == 3 and min(run["step_times_s"]) > 0, run
            step_ms = statistics.median(run["step_times_s"]) * 1e3
            per_round.setdefault(run["round"], {})[run["variant"]] = step_ms
    ratios = [r["ours-sparse-dist"] / r["torchrec-sparse-dist"] for r in per_round.values()]
    expected = {"median": statistics.median(ratios), "low": min(ratios), "high": max(ratios), "rounds": 2}
    assert rows["ours-sparse-dist"]["vs_reference"] == pytest.approx(expected), "the paired ratio"
    assert rows["ours-sparse-dist"]["reference"] == "torchrec-sparse-dist"
    assert rows["plain"]["vs_plain"] is None and rows["ours-base"]["vs_plain"]["rounds"] == 2
    assert rows["plain"]["wait_in_forward_ms"] > 0, "the plain loop's inline input_dist was not measured"
    assert rows["ours-sparse-dist"]["schedule"] and rows["plain"]["schedule"] is None
    assert all(rows[v]["cpu_ms"]["median"] > 0 for v in variants[:4]), "process CPU per step"
    report = md.read_text()
    for words in (
        "Command: `python -m benchmarks run --configs tiny",
        "Machine:",
        "cores",
        "Rounds: 2",
        "[lowest, highest round]",
        "torchrec-prefetch: does not run on CPU",
    ):
        assert words in report, f"the Markdown report lacks {words!r}"


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone since the listing
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_to_the_launcher_kills_its_ranks() -> None:
    """`timeout` around `python -m benchmarks run` (scripts/gpu/run.sh cuts a step at its budget so)
    signals the launcher's process group, which the ranks, in sessions of their own, are not in: the
    launcher kills them before it exits, else a rank would go on holding the GPU after the step."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    argv = "run --configs tiny --variants plain --world-size 1 --steps 2000 --warmup 0 --rounds 1".split()
    argv += ["--profile-steps", "0", "--json", "", "--md", ""]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "benchmarks", *argv],
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not ranks and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
            ranks = _children(launcher.pid)
        assert ranks, f"no rank started: {launcher.poll()}"
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=60)
        assert launcher.returncode == 128 + signal.SIGTERM, (launcher.returncode, err[-2000:])
        assert "the ranks were killed" in err, err[-2000:]
        assert not [r for r in ranks if _alive(r)], "a rank outlived the launcher"
    finally:
        for pid in [launcher.pid, *ranks]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        launcher.wait()


@pytest.mark.slow
def test_the_rest_of_the_family_runs_or_says_it_does_not_on_cpu(tmp_path: Path) -> None:
    family = [
        "ours-fused-sparse-dist",
        "torchrec-fused-sparse-dist",
        "ours-semi-sync",
        "torchrec-semi-sync",
        "ours-eval",
        "torchrec-eval",
        "ours-staged",
        "ours-sparse-dist@late+novote",
    ]
    out = tmp_path / "r.json"
    done = bench(
        "run",
        "--configs",
        "tiny",
        "--variants",
        *family,
        *TINY,
        "--auto-warmup",
        "2",
        "--profile-steps",
        "0",
        "--json",
        str(out),
        "--md",
        "",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["variant"]: r for r in json.loads(out.read_text())["summary"]}
    for variant in family:
        expected = "unsupported" if variant in ("torchrec-fused-sparse-dist", "torchrec-semi-sync") else "ok"
        assert rows[variant]["status"] == expected, f"{variant}: {rows[variant]}"
    assert rows["ours-eval"]["vs_reference"] is not None, "our Eval against torchrec's"


@pytest.mark.slow
def test_tables_on_disk_against_their_bound_at_one_rank(tmp_path: Path) -> None:
    out, md = tmp_path / "t.json", tmp_path / "t.md"
    done = bench(
        "tiered",
        "--world-sizes",
        "1",
        "--configs",
        "tiered-tiny",
        "--steps",
        "3",
        "--warmup",
        "3",
        "--rounds",
        "1",
        "--store-dir",
        str(tmp_path / "stores"),
        "--json",
        str(out),
        "--md",
        str(md),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    runs = {r["variant"]: r for r in json.loads(out.read_text())["world_sizes"][0]["runs"]}
    assert all(r["status"] == "ok" and r["cpu_ms"] > 0 for r in runs.values()), runs
    assert runs["compute-alone"]["cache_hit_rate"] == 1.0, "compute alone must find every row cached"
    io = runs["io-alone"]
    assert io["store_read_ms"] > 0 and io["cache_hit_rate"] < 0.5, f"I/O alone must read the disk: {io}"
    for variant in ("plain", "ours-prefetch", "io-alone"):
        assert runs[variant]["rows_read_per_step"] > 0, f"{variant}: no rows read per step: {runs[variant]}"
        assert runs[variant]["cpu_us_per_row"] > 0, f"{variant}: no CPU per row: {runs[variant]}"
    assert runs["compute-alone"]["cpu_us_per_row"] is None, "compute alone reads no row: no CPU per row"
    assert isinstance(runs["ours-prefetch"]["prefetch_ahead"], bool), "Prefetch's mode is not recorded"
    assert "prefetch_ahead" not in runs["plain"], "the plain loop has no prefetch mode"
    step = {v: statistics.median(r["step_times_s"]) * 1e3 for v, r in runs.items()}
    distance = step["ours-prefetch"] / max(step["io-alone"], step["compute-alone"])
    report = md.read_text()
    assert "| 1 / tiered-tiny |" in report and f"{distance:.2f} [" in report, f"Prefetch / bound:\n{report}"
    cost = re.search(r"a cold 4 KiB read at a random offset takes (\d+) us \((\d+) us of CPU\)", report)
    assert cost, f"the report must give the disk's read cost:\n{report}"
    assert not list((tmp_path / "stores").glob(".read-cost-*")), "the read-cost file was left behind"


@pytest.mark.slow
def test_overhead_gives_each_loop_over_plain_and_its_cprofile(tmp_path: Path) -> None:
    out = tmp_path / "o.json"
    loops = ["ours-sparse-dist", "torchrec-sparse-dist"]
    done = bench("overhead", "--variants", *loops, *TINY, "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert {r["variant"] for r in runs} == {"plain", "ours-sparse-dist", "torchrec-sparse-dist"}
    assert all(r["wall_ms"] > 0 and r["cpu_ms"] > 0 for r in runs), runs
    lines = [line.split() for line in done.stdout.splitlines()]
    head = next((line for line in lines if line[:2] == ["config", "loop"]), [])
    assert {"CPU", "over", "plain"} <= set(head), f"no table of CPU over plain:\n{done.stdout}"
    rows = {line[1] for line in lines if line[:1] == ["tiny"]}
    assert rows >= {"plain", *loops}, f"a loop is missing:\n{done.stdout}"
    profiled = bench("overhead", "--cprofile", "ours-sparse-dist", *TINY, "--only", "pipeline/")
    assert profiled.returncode == 0, profiled.stderr[-3000:]
    assert "| pipeline/" in profiled.stdout, f"no function of pipeline/ in the profile:\n{profiled.stdout}"


def test_overhead_of_models_written_as_users_write_them_is_told_pipelined_and_against_tiny() -> None:
    configs = {"tiny": "1/1", "tiny-split": "2/2", "tiny-built": "1/1", "tiny-shared": "2/2"}
    done = bench("overhead", "--configs", *configs, "--variants", "ours-sparse-dist", *TINY)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line.split() for line in done.stdout.splitlines()]
    for config, sites in configs.items():
        row = next((line for line in lines if line[:2] == [config, "ours-sparse-dist"]), [])
        assert row[-3:] == [sites, "call", "sites"], f"{config}: a call site not pipelined:\n{done.stdout}"
        if config != "tiny":
            assert f"CPU per step on {config} / on tiny" in done.stdout, f"{config}: no ratio to tiny"


def test_hit_rates_no_policy_beats_beladys_optimum(tmp_path: Path) -> None:
    out = tmp_path / "h.json"
    done = bench(
        "hit-rates",
        "--config",
        "tiered-tiny",
        "--batches",
        "60",
        "--skip",
        "20",
        "--tables",
        "2",
        "--fractions",
        "0.05",
        "0.25",
        "--json",
        str(out),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for fraction, rates in json.loads(out.read_text())["hit_rate"].items():
        assert set(rates) >= {"lru", "belady"}, rates
        assert all(0 < v <= rates["belady"] for v in rates.values()), f"{fraction} cached: {rates}"


@pytest.mark.slow
def test_big_tables_reports_the_peak_rss_and_fails_over_the_limit(tmp_path: Path) -> None:
    small = [
        "--total-gb",
        "0.02",
        "--tables",
        "2",
        "--dim",
        "8",
        "--cache-rows",
        "1000",
        "--batch-size",
        "16",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--store-dir",
        str(tmp_path / "stores"),
    ]
    done = bench("big-tables", *small)
    assert done.returncode == 0 and "peak_rss_mib" in done.stdout, done.stdout + done.stderr[-3000:]
    assert not list((tmp_path / "stores").glob("*.rows")), "the store files were not deleted"
    over = bench("big-tables", *small, "--rss-limit-gb", "0.001")
    assert over.returncode == 1, f"a peak RSS over the limit must fail: {over.returncode}\n{over.stdout}"
