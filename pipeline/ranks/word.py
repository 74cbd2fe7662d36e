"""The word a rank sends for one batch where its status rides on the fused splits all-to-all
(`pipeline.ranks.riding`): its `Status`, a tag and its row count, so that the receiver can tell
that the row it reads is a status row and not a split, and one observation of the job's own steps
(`pipeline.stages.step_watch`: the schedule watch's or the prefetch watch's, taking turns), so that
the ranks agree on what the steps show without a collective of their own.

Layout (31 bits, so that torchrec's optional int32 check of the splits passes it):

    bits 0-1    status (`Status`, 0..3)
    bits 2-7    TAG
    bits 8-17   the sender's status row index (its splits rows before the status row), mod 1,024
    bits 18-30  observation: bits 18-29 the figure (0 none, else round(1,000 x value) + 1, at
                most 4,093; 4,094 and 4,095: a decision loaded from a checkpoint, `RESTORED`),
                bit 30 which watch it belongs to (0 or 1)
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.ranks.status import Status

__all__ = ["RESTORED", "TAG", "Word", "figure_of", "observed", "pack", "tagged", "unpack"]

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
    if value is None:
        return 0
    return min(RESTORED[0] - 1, 1 + max(0, round(value * 1000)))


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
