"""The input_dist schedules, each two choices: whether the splits all-to-all of batch i+1 is waited
for before forward of batch i ("early") or after it ("late", torchrec's order), and whether the
input all-to-alls run on a process group of their own (`pipeline.stages.groups.InputDistGroups`) or
on torchrec's. Numerics are the same under every schedule. The default, "adaptive", starts in "late"
and may move to "early" (`pipeline.stages.watch`). docs/reference.md, "Schedules", weighs them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SCHEDULES", "Schedule"]


@dataclass(frozen=True, slots=True)
class Schedule:
    """One input_dist schedule."""

    early_splits: bool
    """Wait for the next batch's splits before forward (True) or after it (False)."""
    own_group: bool
    """Input all-to-alls on a process group of their own (True) or on torchrec's (False)."""


SCHEDULES: dict[str, Schedule] = {
    "early": Schedule(early_splits=True, own_group=True),
    "late": Schedule(early_splits=False, own_group=False),
    "early-shared": Schedule(early_splits=True, own_group=False),
    "late-own": Schedule(early_splits=False, own_group=True),
}
