"""Time what a new user runs first, on a fresh clone: `make setup`, `make demo`, `make test`.

    python3 scripts/fresh_clone.py --out docs/results/fresh-clone.json      # or: make time-fresh-clone

Clones this repository's committed HEAD into a temporary folder, runs each target there in turn
(with nothing but python3 on the PATH's Python and the network, as on a new machine; pip's cache is
what it is, and its size before the set-up is recorded), and writes one JSON file: the command, the
machine, the date, the commit, and per target its wall seconds and exit status (for `make test`,
pytest's summary line too). README.md quotes its times, and tests/test_doc_promises.py checks that
the README's times are the file's. It runs for minutes and downloads gigabytes on a cold cache: run
it on a quiet machine, never from a test. Standard library only: it runs before any venv exists.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ("setup", "demo", "test")
"""What a new user runs, in order: the set-up alone, then the README's two commands."""


def machine() -> str:
    """CPU model, cores and kernel (the stack is the Makefile's pins, recorded beside it)."""
    cpu = platform.processor() or platform.machine()
    info = Path("/proc/cpuinfo")
    for line in info.read_text().splitlines() if info.exists() else []:
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


def pip_cache_bytes() -> int | None:
    """The size of pip's cache before the set-up (0: a cold cache), or None if pip cannot say."""
    proc = subprocess.run([sys.executable, "-m", "pip", "cache", "dir"], capture_output=True, text=True)
    if proc.returncode != 0 or not Path(proc.stdout.strip()).is_dir():
        return 0 if proc.returncode == 0 else None
    return sum(f.stat().st_size for f in Path(proc.stdout.strip()).rglob("*") if f.is_file())


def run_target(clone: Path, target: str) -> dict:
    """`make <target>` in `clone`, timed; its status, seconds and (for tests) pytest's summary."""
    start = time.monotonic()
    proc = subprocess.run(["make", target], cwd=clone, capture_output=True, text=True)
    seconds = time.monotonic() - start
    result = {"target": target, "seconds": round(seconds, 1), "status": proc.returncode}
    summary = re.findall(r"^=+ (.*\b(?:passed|failed)\b.*) =+$", proc.stdout, re.M)
    if summary:
        result["pytest"] = summary[-1]
    if proc.returncode != 0:
        result["output_tail"] = (proc.stdout + proc.stderr)[-4000:]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/fresh_clone.py", description=__doc__)
    parser.add_argument("--out", default="docs/results/fresh-clone.json", help="the JSON file to write")
    args = parser.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    record = {
        "command": f"python3 scripts/fresh_clone.py --out {args.out}",
        "machine": machine(),
        "date": datetime.date.today().isoformat(),
        "commit": commit.strip(),
        "pip_cache_bytes_before": pip_cache_bytes(),
        "targets": [],
    }
    work = Path(tempfile.mkdtemp(prefix="fresh-clone-"))
    try:
        clone = work / "repo"
        subprocess.run(["git", "clone", "--quiet", "--no-local", str(ROOT), str(clone)], check=True)
        for target in TARGETS:
            result = run_target(clone, target)
            record["targets"].append(result)
            print(f"make {target}: {result['seconds']} s, status {result['status']}", flush=True)
            if result["status"] != 0:
                break
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = ROOT / args.out
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if all(t["status"] == 0 for t in record["targets"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
