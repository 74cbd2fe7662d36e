"""What a lost rank costs: the training stall per checkpoint, the time from a SIGKILL to the
survivors' exit, and the time from the kill to the first step of the restarted job.

    python -m benchmarks.faults --rounds 3 --steps 200 --every 50 --kill-at 120

Each round runs the DLRM example under `torchrun --standalone --nproc_per_node=2 --max-restarts=1`
with `--inject-kill 1:step:K`: rank 1 SIGKILLs itself after step K, after appending a `kill` line
(wall time) to the example's `--loss-log`. This process polls rank 0's pid (read from the log) every
2 ms to time the survivors' exit, and reads the restarted attempt's `built`, `resumed` and first
step lines from the log. The stall per checkpoint is the example's `checkpoint_save_ms` (rank 0's
mean time inside a save, barriers included) from an uninterrupted run of the same flags. Medians
over the rounds are printed, and written as JSON with `--json`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

__all__ = ["main"]

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    rounds = [_round(args, i) for i in range(args.rounds)]
    keys = [k for k in rounds[0] if isinstance(rounds[0][k], float)]
    medians = {k: round(statistics.median(r[k] for r in rounds), 3) for k in keys}
    for key, value in medians.items():
        print(f"{key:<28} {value:>9.3f}   rounds: {', '.join(f'{r[key]:.3f}' for r in rounds)}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        report = {"args": vars(args), "rounds": rounds, "median": medians}
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def _round(args: argparse.Namespace, index: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="faults-") as tmp:
        plain = _train(args, Path(tmp) / "plain", kill=False)
        killed = _train(args, Path(tmp) / "killed", kill=True)
    result = {**plain, **killed}
    print(f"round {index}: {json.dumps(result)}", file=sys.stderr)
    return result


def _train(args: argparse.Namespace, out: Path, *, kill: bool) -> dict:
    out.mkdir(parents=True)
    log, summary = out / "losses.txt", out / "summary.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += ["--max-restarts=1", "examples/dlrm/train.py", "--pipeline", args.pipeline, "--no-progress"]
    cmd += ["--steps", str(args.steps), "--checkpoint-dir", str(out / "ckpt")]
    cmd += ["--checkpoint-every", str(args.every), "--loss-log", str(log), "--summary-json", str(summary)]
    cmd += args.extra
    if kill:
        cmd += ["--inject-kill", f"1:step:{args.kill_at}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    watcher = _ExitWatcher(log) if kill else None
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"training failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    found = json.loads(summary.read_text())
    if not kill:
        return {"checkpoint_save_ms": float(found["checkpoint_save_ms"]), "step_ms": found["step_time_ms"]}
    assert watcher is not None
    events = _events(log)
    killed_at = events[("kill", 0)]
    return {
        "kill_to_survivor_exit_s": watcher.exited_at - killed_at,
        "kill_to_restart_built_s": events[("built", 1)] - killed_at,
        "kill_to_resumed_s": events[("resumed", 1)] - killed_at,
        "kill_to_first_step_s": events[("step", 1)] - killed_at,
        "steps_retrained": float(args.kill_at - found["resumed_from_step"]),
    }


def _events(log: Path) -> dict[tuple[str, int], float]:
    """Earliest wall time of each (event, attempt) over the ranks; steps count as `step`."""
    found: dict[tuple[str, int], float] = {}
    for line in log.read_text().splitlines():
        _, attempt, what, _, wall, _ = line.split()
        key = ("step" if what.isdigit() else what, int(attempt))
        found[key] = min(found.get(key, float("inf")), float(wall))
    return found


class _ExitWatcher:
    """Finds rank 0's pid of the first attempt in the log, then polls until that process is gone."""

    def __init__(self, log: Path) -> None:
        self.exited_at = float("nan")
        self._log = log
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        pid = None
        while pid is None:
            if self._log.exists():
                for line in self._log.read_text().splitlines():
                    rank, attempt, *_, last = line.split()
                    if rank == "0" and attempt == "0":
                        pid = int(last)
                        break
            time.sleep(0.05)
        while _alive(pid):
            time.sleep(0.002)
        self.exited_at = time.time()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")  # a zombie has exited; torchrun reaps it later


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pipeline", default="prefetch")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=50, help="steps between checkpoints")
    p.add_argument("--kill-at", type=int, default=120, help="rank 1 dies after this step")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", help="also write the rounds and medians here")
    p.add_argument("extra", nargs="*", help="more flags for train.py (after --)")
    return p


if __name__ == "__main__":
    sys.exit(main())
