"""Aids for showing and testing that training survives a lost rank: a planned SIGKILL of one rank
(`--inject-kill`), and a log of every step's exact loss on every rank (`--loss-log`).

The kill happens only in the first attempt of a torchrun job (`TORCHELASTIC_RESTART_COUNT` unset or
0), so the restarted group runs to the end. Before it dies, the rank appends a `kill` line to the
loss log (wall time), from which benchmarks measure how long the survivors take to exit and how
long until the first resumed step.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from examples.dlrm.config import InputError
from examples.dlrm.elastic import attempt

__all__ = ["KillPlan", "LossLog"]


@dataclass(kw_only=True, slots=True, frozen=True)
class KillPlan:
    """Kill rank `rank` with SIGKILL at step `step` (after that step), or in the middle of the
    checkpoint saved at that step (its shards written, not yet committed)."""

    rank: int
    """The rank that dies."""
    step: int
    """The step at (or after) which it dies."""
    during_save: bool
    """Die inside the save at `step` instead of after the step."""

    @classmethod
    def parse(cls, spec: str) -> KillPlan:
        """`RANK:step:N` or `RANK:save:N`.

        Raises:
            InputError: `spec` has another form.
        """
        parts = spec.split(":")
        if len(parts) != 3 or parts[1] not in ("step", "save") or not (parts[0] + parts[2]).isdigit():
            raise InputError(
                f"--inject-kill takes RANK:step:N (die after step N) or RANK:save:N (die while saving "
                f"the checkpoint of step N), e.g. 1:step:25; got {spec!r}"
            )
        return cls(rank=int(parts[0]), step=int(parts[2]), during_save=parts[1] == "save")

    def maybe_kill(self, *, rank: int, step: int, in_save: bool, log: LossLog | None) -> None:
        """SIGKILL this process if the plan says so for this rank, step and place (first attempt
        only)."""
        if rank != self.rank or step != self.step or in_save != self.during_save or attempt() > 0:
            return
        where = "while saving the checkpoint of" if in_save else "after"
        print(f"dlrm: --inject-kill: rank {rank} dies {where} step {step}", file=sys.stderr, flush=True)
        if log is not None:
            log.event("kill", step)
        os.kill(os.getpid(), signal.SIGKILL)


class LossLog:
    """Appends `rank attempt step loss wall pid` lines to a file, one per step and rank; the loss as
    `float.hex()` (exact). Other lines: `rank attempt event step wall pid`.

    Every rank appends to the same file; each line is one `write` of a line-buffered file opened
    for appending, so lines of different ranks do not interleave.
    """

    def __init__(self, path: str, *, rank: int) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", buffering=1)
        self._rank = rank
        self._attempt = attempt()

    def step(self, step: int, loss: float) -> None:
        self._write(f"{step} {float(loss).hex()}")

    def event(self, name: str, step: int) -> None:
        self._write(f"{name} {step}")

    def _write(self, text: str) -> None:
        self._file.write(f"{self._rank} {self._attempt} {text} {time.time():.6f} {os.getpid()}\n")

    def close(self) -> None:
        self._file.close()
