"""The status row: each rank's word for a batch, sent as one more row of the batch's fused splits
all-to-all, which every rank issues anyway (`Admission`, `pipeline.ranks.riding`, decides from them).

The word (31 bits, so that torchrec's optional int32 check of the splits passes it):

    bits 0-1    status (`Status`, 0..3)
    bits 2-7    TAG
    bits 8-17   the sender's status row index (its splits rows before the status row), mod 1,024
    bits 18-30  observation: bits 18-29 the figure (0 none, else round(1,000 x value) + 1, at
                most 4,093; 4,094 and 4,095: a decision loaded from a checkpoint, `RESTORED`),
                bit 30 which watch it belongs to (0 or 1)

The tag and the row count let the receiver tell a status row from a split; the observation is one
figure of the job's own steps (`pipeline.stages.step_watch`: the schedule watch's or the prefetch
watch's, taking turns), so that the ranks agree on what the steps show without a collective of
their own.

`StatusSplits` is torchrec's fused splits awaitable (`FusedKJTListSplitsAwaitable`) with the word
after the splits, built through `rewrite.fuse_splits_requests(carrier=...)`; a rank without the
batch sends `StatusOnly` in its place: zero splits in the shape recorded from an earlier batch
(`splits_shape`), and its word. Both edit or mirror torchrec's private fields (`_awaitables`,
`_lengths`, `_splits_awaitable`), so `riding_fits` checks, before statuses ride, that the installed
torchrec has them and that every input dist is one this code knows to issue nothing but its splits
and values all-to-alls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchrec.distributed.dist_data import KJTAllToAll, SplitsAllToAllAwaitable
from torchrec.distributed.embedding_sharding import FusedKJTListSplitsAwaitable, KJTSplitsAllToAllMeta
from torchrec.distributed.types import NoWait

from pipeline.ranks.status import Status

__all__ = [
    "RESTORED",
    "TAG",
    "StatusOnly",
    "StatusSplits",
    "Word",
    "figure_of",
    "observed",
    "pack",
    "riding_fits",
    "settle_splits",
    "splits_shape",
    "tagged",
    "unpack",
    "validating",
]

TAG = 0b101101
"""Marks a status word. A split (a count of ids or a batch size) read by mistake in its place
matches it and the row count by chance once in 65,536."""
_ROWS = 1 << 10
_FIGURE_BITS = 12
_OBSERVED_MAX = (1 << _FIGURE_BITS) - 1
RESTORED = (_OBSERVED_MAX - 1, _OBSERVED_MAX)
"""The figure of a watch holding a decision loaded from a checkpoint, per mode (its start mode, the
other): no observation reaches them."""


@dataclass(frozen=True, slots=True)
class Word:
    """One rank's word for one batch, unpacked."""

    status: int
    tag: int
    rows: int
    """The sender's status row index, mod 1,024."""
    observation: int
    """Which watch (`figure_of`) and its figure: 0: none; else round(1,000 x value) + 1."""


def observed(value: float | None) -> int:
    """`value` (a fraction or a ratio, >= 0) as the word's observation field; None: none."""
    return 0 if value is None else min(RESTORED[0] - 1, 1 + max(0, round(value * 1000)))


def tagged(which: int, figure: int) -> int:
    """The observation field carrying watch `which`'s (0 or 1) `figure` (`observed()`)."""
    return which << _FIGURE_BITS | figure if figure else 0


def figure_of(observation: int) -> tuple[int, int]:
    """(which watch, its figure) of an observation field (figure 0: none)."""
    return observation >> _FIGURE_BITS, observation & _OBSERVED_MAX


def pack(status: Status | int, rows: int, observation: int = 0) -> int:
    """The word of `status` sent with `rows` splits rows before it (`observation`: `tagged()`)."""
    return int(status) | TAG << 2 | (rows % _ROWS) << 8 | observation << 18


def unpack(word: int) -> Word:
    """The fields of a received word (check `tag` and `rows` before trusting the rest)."""
    return Word(status=word & 3, tag=(word >> 2) & 0x3F, rows=(word >> 8) % _ROWS, observation=word >> 18)


class _StatusRow:
    """A splits all-to-all with a status row after its `rows` splits rows."""

    rows: int
    _splits_awaitable: Any

    def words(self) -> list[int]:
        """Per rank, what it sent at this rank's status row (a word if the ranks sent alike). The
        splits are waited once: torchrec's own wait then reads the same rows."""
        received = self._splits_awaitable.wait()
        self._splits_awaitable = NoWait(received)
        return received[self.rows] if self.rows < len(received) else []  # too few: the receiver reports it


class StatusSplits(_StatusRow, FusedKJTListSplitsAwaitable):
    """torchrec's fused splits all-to-all (built by `rewrite.fuse_splits_requests(carrier=...)`) with
    one row more: this rank's word for the batch (`word(rows)`, from the number of splits rows before
    it), which every rank receives (`words()`) before the values all-to-alls, which `wait()` starts,
    are issued. The row rides on the last module's splits while the all-to-all is built and is left
    out when the splits are read.

    Raises:
        RuntimeError: torchrec's fused awaitable is not of the shape this class edits (a torchrec
            release that changed it; `riding_fits` checks for that first).
    """

    def __init__(self, requests: list[Any], contexts: list[Any], pg: Any, word: Callable[[int], int]) -> None:
        rows, last, at, position = 0, None, 0, 0
        for request in requests:  # the last module's splits, at `at` in torchrec's flat list
            for awaitable in request.awaitables:
                if isinstance(awaitable, KJTSplitsAllToAllMeta):
                    rows, last, at = rows + len(awaitable.splits_tensors), awaitable, position
                position += 1
        self.rows = rows
        """The splits rows this rank sends before its word (its word's row index)."""
        status_row = torch.full((pg.size(),), word(rows), dtype=torch.int64, device=last.device)
        last.splits_tensors.append(status_row)
        try:
            super().__init__(requests=requests, contexts=contexts, pg=pg)
        finally:
            last.splits_tensors.pop()
        if self._awaitables[at] is not last or sum(self._lengths) != rows + 1:
            raise RuntimeError(f"torchrec's fused splits awaitable does not count {rows} rows and a word")
        self._lengths[at] -= 1
        self.carries = True


class StatusOnly(_StatusRow):
    """What a rank without the batch sends where the others send their fused splits: `rows` rows
    of zero splits (the shape the others send) and, where the others send `StatusSplits`, its
    word."""

    def __init__(self, pg: Any, rows: int, word: int | None, device: torch.device) -> None:
        world = pg.size()
        tensors = [torch.zeros(world, dtype=torch.int64, device=device) for _ in range(rows)]
        if word is not None:
            tensors.append(torch.full((world,), word, dtype=torch.int64, device=device))
        self.rows = rows
        self._splits_awaitable = SplitsAllToAllAwaitable(tensors, pg)
        self.carries = word is not None

    def wait(self) -> list[Any]:
        raise RuntimeError("a rank that sent only its status has no batch to distribute")


def splits_shape(fused: list[tuple[list[str], Any]]) -> list[tuple[Any, int, torch.device, bool]] | None:
    """What one batch's `fuse_splits_requests(..., carrier=...)` sends, so that a rank without a batch
    can send the same: per group, its process group, the number of splits rows, their device, and
    whether the status rides there. None if no group spans every rank (the status cannot ride)."""
    shape, rides = [], False
    for _, awaitable in fused:
        for meta in getattr(awaitable, "_awaitables", ()):
            if isinstance(meta, KJTSplitsAllToAllMeta):  # the group's first: its group and device
                if meta.pg is not None:
                    carries = isinstance(awaitable, StatusSplits)
                    shape.append((meta.pg, sum(awaitable._lengths), meta.device, carries))
                    rides = rides or carries
                break
    return shape if rides else None


def settle_splits(fused: list[tuple[list[str], Any]]) -> None:
    """Wait for the splits all-to-all of each awaitable of a batch the ranks refused
    (`fuse_splits_requests`' or `StatusOnly`), starting no values all-to-all: none is left in
    flight, on any group."""
    for _, awaitable in fused:
        if getattr(awaitable, "_splits_awaitable", None) is not None:
            awaitable._splits_awaitable.wait()


_FIELDS_USED = {
    KJTAllToAll: ("_pg", "_splits", "_splits_cumsum", "_stagger"),
}
_AWAITABLE_FIELDS = ("_awaitables", "_lengths", "_splits_awaitable")
_INPUT_DISTS = (
    "TwSparseFeaturesDist",
    "RwSparseFeaturesDist",
    "CwSparseFeaturesDist",
    "DpSparseFeaturesDist",
)
"""torchrec's input dists whose forward issues nothing but its KJTAllToAll (or nothing at all)."""


def riding_fits(modules: list[nn.Module]) -> str | None:
    """None if statuses can ride on these sharded modules' fused splits; else why not (the
    pipeline then votes on every batch). Decided from the code alone, so the same on every rank
    that runs the same torchrec and model."""
    names = set(FusedKJTListSplitsAwaitable.__init__.__code__.co_names)
    missing = [f for f in _AWAITABLE_FIELDS if f not in names]
    if missing:
        return f"torchrec's FusedKJTListSplitsAwaitable no longer sets {', '.join(missing)}"
    for module in modules:
        for child in module.modules():
            for input_dist in getattr(child, "_input_dists", None) or []:
                kind = type(input_dist)
                if not any(
                    c.__name__ in _INPUT_DISTS and c.__module__.startswith("torchrec.") for c in kind.__mro__
                ):
                    return f"input dist {kind.__qualname__} may issue collectives of its own"
                a2a = getattr(input_dist, "_dist", None)
                if a2a is None:
                    continue
                if not isinstance(a2a, KJTAllToAll):
                    return f"input dist {kind.__qualname__} sends with {type(a2a).__qualname__}"
                absent = [f for f in _FIELDS_USED[KJTAllToAll] if not hasattr(a2a, f)]
                if absent:
                    return f"torchrec's KJTAllToAll has no {', '.join(absent)}"
    return None


def validating() -> bool:
    """torchrec can tag each splits all-to-all to check that the ranks' collectives match; a rank
    without a batch could not send the tag, so statuses do not ride then."""
    try:
        from torchrec.distributed.collective_utils import validate_collectives_enabled
    except ImportError:  # an older torchrec: no tags
        return False
    return validate_collectives_enabled()
