"""`SavedDecision`: a watch's decision as a checkpoint holds it, with the world size it was taken
at, and the figure a watch publishes while every rank's word has yet to show it
(`pipeline.stages.step_watch.StepWatch.load_state_dict`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from pipeline.ranks.rows import RESTORED

__all__ = ["SavedDecision", "world_size"]


def world_size() -> int:
    """The job's world size (1 without a process group)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@dataclass(frozen=True, slots=True)
class SavedDecision:
    """One final decision of a watch whose modes are `modes`."""

    phase: str
    """"kept", "back" or "pinned" (`WatchPhase`'s values)."""
    mode: str
    decisions: tuple[tuple[int, str], ...]
    world_size: int | None
    """The world size it was taken at (None: a state saved before it was recorded)."""
    code: int
    """The figure a watch holding it publishes (`pipeline.ranks.rows.RESTORED`, by mode)."""

    @classmethod
    def parse(
        cls, state: dict[str, Any], modes: tuple[str, str], final: tuple[str, ...]
    ) -> SavedDecision | None:
        """The decision in `state` (a `state_dict()`), or None where it holds none (empty, or saved
        while watching or trying: phases not in `final`).

        Raises:
            ValueError: the state names a mode that is not one of `modes`.
        """
        if not state or state["phase"] not in final:
            return None
        mode = state.get("mode", state.get("schedule"))
        if mode not in modes:
            raise ValueError(f"a saved watch state names {mode!r}, not one of {modes}")
        decisions = tuple(tuple(d) for d in state["decisions"])
        return cls(state["phase"], mode, decisions, state.get("world_size"), RESTORED[modes.index(mode)])

    def refused(self, world: int, *, pinned_to: str | None) -> str | None:
        """Why a watch of a `world`-rank job does not take it (None: it may): taken at another world
        size (an elastic restart watches afresh), or the other mode for a watch `pinned_to` a mode
        because nothing rides (the ranks could not agree on it; at one rank there is none to)."""
        if self.world_size is not None and self.world_size != world:
            return f"a decision saved at world size {self.world_size} is not taken at {world}: watching again"
        if pinned_to is not None and self.mode != pinned_to and world > 1:
            return f"a saved {self.mode!r} is not taken: nothing rides, so the ranks cannot agree on it"
        return None

    def held_by_all(self, observations: list[int]) -> bool:
        """Every rank's word for the batch shows this decision."""
        return bool(observations) and all(o == self.code for o in observations)
