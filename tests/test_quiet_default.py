"""The default path inside a user's training job does nothing the user did not ask for: under real
torchrun, with `HOME` an empty folder and the working directory an empty folder, the DLRM example
trains with a pipeline's defaults and

- our code starts no process on any rank (none during the run, none left after it). Each start is
  attributed to the Python stack that made it (an audit hook, tests/quiet_probe/). The only ones
  allowed come from the example's own imports, with none of our code on the stack: torch's CUDA
  build runs `/sbin/ldconfig -p` (ctypes.util.find_library) on `import torch`. (The example computes
  its AUC itself: torchmetrics would import matplotlib, which starts `fc-list` and writes a font
  cache under HOME.) A process that no rank's Python started (the run is also watched through
  /proc) fails the test;
- nothing is written under `HOME`, and nothing in the working directory but the file the user named;
- the library's own source has no subprocess, file lock, home-directory path or multiprocessing on
  the training path, and `import pipeline` imports neither the cost model nor the benchmarks.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).parent / "torchrun"
SMALL = ["--batch-size", "8", "--num-embeddings", "100", "--embedding-dim", "4", "--no-progress"]
TRAINING_PATH = ("pipeline", "rewrite", "tiered")
PROBE = ROOT / "tests" / "quiet_probe"
FORBIDDEN = re.compile(r"\b(subprocess|fcntl|multiprocessing)\b|Path\.home\(|expanduser\(")


def _children(pid: int) -> dict[int, int]:
    """Every live process's parent, by pid."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    return parents


def _descendants(root: int) -> dict[int, int]:
    """Descendants of `root` with their depth below it (1: its children)."""
    parents = _children(root)
    depth = {root: 0}
    changed = True
    while changed:
        changed = False
        for pid, parent in parents.items():
            if parent in depth and pid not in depth:
                depth[pid] = depth[parent] + 1
                changed = True
    depth.pop(root)
    return depth


def _cmdline(pid: int) -> str:
    """Its command line; for one that exited before it was read (a zombie has none), "[NAME]": the
    process name the kernel keeps (15 characters at most)."""
    try:
        line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        if line:
            return line
        stat = Path(f"/proc/{pid}/stat").read_text(errors="replace")
        return f"[{stat[stat.index('(') + 1 : stat.rindex(')')]}]"
    except (OSError, ValueError):
        return "?"


def _starts(log: Path) -> list[dict]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines()]


def _from_an_import_of_theirs(start: dict) -> bool:
    """Started while a third-party package ran its module body on import, with none of our code on
    the stack."""
    ours = [f for f in start["stack"] if any(f.startswith(str(ROOT / d) + os.sep) for d in TRAINING_PATH)]
    importing = any(f.endswith(":<module>") and f"{os.sep}site-packages{os.sep}" in f for f in start["stack"])
    return importing and not ours


def _describe(start: dict) -> str:
    return f"{' '.join(start['argv']) or start['event']} from\n  " + "\n  ".join(start["stack"][:20])


def _has_env(pid: int, entry: str) -> bool:
    try:
        return entry.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("pipe", "schedule"), [("sparse-dist", "adaptive"), ("prefetch", "early")])
def test_a_job_under_torchrun_starts_no_process_and_writes_nothing_unasked(tmp_path, pipe, schedule):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(
        HOME=str(home),
        OMP_NUM_THREADS="1",
        PYTHONPATH=f"{ROOT}{os.pathsep}{PROBE}",
        QUIET_PROBE_LOG=str(tmp_path / "starts.jsonl"),
        XDG_CACHE_HOME=str(home / ".cache"),  # where a cache under the home directory would go
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),  # torch's own, outside the check
    )
    cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node=2", str(ROOT / "examples/dlrm/train.py")]
    cmd += ["--pipeline", pipe, "--input-dist-schedule", schedule, "--steps", "30", *SMALL]
    cmd += ["--summary-json", "summary.json"]
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    started, grandchildren, workers = time.monotonic(), {}, {}
    while proc.poll() is None and time.monotonic() - started < 240:
        # torchrun (depth 0) -> its workers (depth 1); anything deeper was started by a rank
        tree = _descendants(proc.pid)
        for pid, depth in tree.items():
            if depth >= 2:
                line = _cmdline(pid)
                if line != "?" and (pid not in grandchildren or line != grandchildren[pid]):
                    grandchildren[pid] = line  # caught between fork and exec, it has its parent's line
                    workers.setdefault(pid, {p: _cmdline(p) for p, d in tree.items() if d == 1})
        time.sleep(0.1)
    if proc.poll() is None:
        proc.kill()
    out = proc.communicate(timeout=30)[0].decode(errors="replace")
    assert proc.returncode == 0, out[-4000:]
    starts = _starts(tmp_path / "starts.jsonl")
    ranks = [s for s in starts if s["pid"] != proc.pid]  # torchrun's own starts are its workers
    assert any("ldconfig" in " ".join(s["argv"]) for s in ranks), (
        "the audit hook saw not even torch's ldconfig"
    )
    others = [s for s in ranks if not _from_an_import_of_theirs(s)]
    assert not others, "a rank started processes:\n" + "\n\n".join(_describe(s) for s in others)
    seen = {" ".join(s["argv"]) for s in ranks}
    seen |= {f"[{Path(s['argv'][0]).name[:15]}]" for s in ranks if s["argv"]}  # exited before it was read
    forking = {s["pid"] for s in ranks}
    unseen = {
        pid: line
        for pid, line in grandchildren.items()
        if line.strip() not in seen  # an exec'd command some rank's Python started
        and not any(line == wline and wpid in forking for wpid, wline in workers[pid].items())  # pre-exec
    }
    assert not unseen, f"a rank started processes its Python did not: {unseen}"
    time.sleep(1)  # a process that was left behind is still alive after its parents exited
    left = [pid for pid in _children(0) if _has_env(pid, f"HOME={home}")]
    assert not left, f"processes left behind: {[_cmdline(p) for p in left]}"
    assert sorted(p.name for p in home.rglob("*")) == [], "something was written under HOME"
    assert sorted(p.name for p in work.iterdir()) == ["summary.json"], "only the file the user named"


def test_the_training_path_has_no_subprocess_lock_or_home_directory():
    found = []
    for folder in TRAINING_PATH:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if FORBIDDEN.search(code):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_import_pipeline_loads_no_cost_model_or_tool():
    code = (
        "import sys, pipeline; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'benchmarks', 'timeline', 'matplotlib'}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout
