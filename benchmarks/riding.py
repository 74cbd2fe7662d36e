"""`python -m benchmarks riding`: the host work of the ranks' agreement per batch, where the statuses
ride on the splits all-to-all, at world sizes no machine here runs (8 to 1,024 ranks, simulated).

Per batch a rank does two things besides the all-to-all itself, which torchrec's pipeline issues too:
it packs its word into the splits (`Admission.status_splits`), and at the splits wait it reads every rank's
word (`Admission.read_statuses`). This times both, in one process, on the words that `world` ranks would
send: while a watch is live (every word carries a figure, each is read and handed to the watch) and
once every watch has decided (every word is the plain "have it" word, checked in one pass in C).
Process CPU time per batch, median over rounds; no ranks, no network.
"""

from __future__ import annotations

import platform
import statistics
import time
from typing import Any

import torch

from benchmarks.report import markdown_table, stamp, text_table, write

__all__ = ["riding"]

_ROWS = 17
"""Splits rows a rank sends before its word (any count: the word's row index)."""


class _ReceivedStatusSplits:
    """The fused splits awaitable's face to `read_statuses`: the words, already received, as the real
    one has them: the all-to-all's output tensor and torchrec's own list of it (both made outside
    our code: the collective writes the one, torchrec's splits wait makes the other)."""

    carries = True

    def __init__(self, words: list[int], received: torch.Tensor) -> None:
        self.words_sent, self.received_rows, self.rows = words, received, _ROWS

    def words(self) -> list[int]:
        return self.words_sent


class _Ranks:
    """The ranks' protocol as `Admission` reads it; `admit_from_counts` is the real one (unbound)."""

    voting, carrying = True, True

    def admit_from_counts(self, lane: Any, ctx: Any, counts: Any) -> bool:
        from pipeline.ranks.protocol import Ranks

        return Ranks.admit_from_counts(self, lane, ctx, counts)


def _one(world: int, watching: bool, batches: int) -> float:
    """Microseconds of process CPU per batch: pack this rank's word, then read `world` words."""
    from pipeline.ranks import Status
    from pipeline.ranks.protocol import Lane, Ticket
    from pipeline.ranks.riding import Admission, observed, pack, tagged
    from pipeline.stages.context import BatchContext
    from pipeline.stages.schedule import ScheduleWatch

    watch = ScheduleWatch(window=8, threshold=0.99, patience=0)  # watching for ever: the shares stay low
    admission = Admission(_Ranks(), True, watch=watch)
    admission._shape = [("pg", _ROWS, "cpu", True)]
    if not watching:
        watch.pin("decided")
    figure = tagged(0, observed(0.3)) if watching else 0
    words = [pack(Status.HAVE, _ROWS, figure) for _ in range(world)]
    words = [int(str(w)) for w in words]  # distinct int objects, as a received list holds
    received = torch.zeros(world, _ROWS + 1, dtype=torch.int64)  # every rank's splits rows, then its word
    received[:, _ROWS] = torch.tensor(words)
    watch._published = observed(0.3) if watching else 0
    lane = Lane(iter(()))
    start = time.process_time()
    for i in range(batches):
        ticket = Ticket(position=i, status=Status.HAVE, carried=True)
        ctx = BatchContext(index=i, streams=None, ticket=ticket, status_rides=True)
        make = admission.status_splits(ctx)
        make.keywords["word"](_ROWS)
        ctx.splits_requests = [([], _ReceivedStatusSplits(words, received))]
        if not admission.read_statuses(ctx, lane):
            raise RuntimeError("a batch every rank has was refused")
    return (time.process_time() - start) / batches * 1e6


def riding(
    *, world_sizes: list[int], batches: int, rounds: int, command: str, json: str | None, md: str | None
) -> int:
    rows, result = [], {"command": command, "machine": platform.processor() or platform.machine(), "runs": {}}
    for world in world_sizes:
        figures = {}
        for watching in (True, False):
            runs = [_one(world, watching, batches) for _ in range(rounds)]
            figures["watching" if watching else "decided"] = runs
        result["runs"][world] = figures  # watching, then decided: the columns' order
        rows.append(
            [world, *(f"{statistics.median(r):.1f} [{min(r):.1f}, {max(r):.1f}]" for r in figures.values())]
        )
    columns = ["ranks", "watching us/batch", "decided us/batch"]
    print(text_table(columns, rows))
    rounds_text = f"{batches} batches a round, {rounds} rounds, process CPU time: median [lowest, highest]."
    lines = [*stamp(command), "", rounds_text, ""]
    lines += markdown_table(columns, rows)
    write(result, "\n".join(lines) + "\n", json_path=json, md_path=md)
    return 0
