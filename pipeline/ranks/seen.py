"""Whether the model's last forward waited for an all-to-all over every rank.

TrainPipelineBase has no input_dist of its own, so the first collective of its step that every rank
issues after fetching the next batch is inside the model: a sharded module's input all-to-all.
A forward hook on each sharded module whose process group spans the world tells when one ran.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rewrite import outermost_sharded

__all__ = ["WorldCollectiveSeen"]


class WorldCollectiveSeen:
    """Forward hooks on the model's sharded modules whose input all-to-all spans every rank.

    Such a module's forward waits for its input all-to-all before it computes, so once the hook
    fired, every rank has issued that all-to-all. `remove()` takes the hooks off the model again.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._seen = False
        world = dist.get_world_size()
        self._hooks = [
            module.register_forward_hook(self._saw)
            for module in outermost_sharded(model).values()
            if _all_to_all_over(module, world)
        ]

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _saw(self, *_: Any) -> None:
        self._seen = True

    def take(self) -> bool:
        """True once per forward that ran such a module."""
        seen, self._seen = self._seen, False
        return seen


def _all_to_all_over(module: torch.nn.Module, world: int) -> bool:
    """The sharded module's input all-to-all spans `world` ranks: its sharding's process group (a 2D
    sharding's is `sharding_pg`) has them all, and some table is not data-parallel (whose input_dist
    moves nothing). Unknown attributes (another kind of sharded module) answer False."""
    env = getattr(module, "_env", None)
    group = getattr(env, "sharding_pg", None) or getattr(env, "process_group", None)
    kinds = getattr(module, "_sharding_types", None) or []
    return group is not None and group.size() == world and any(k != "data_parallel" for k in kinds)
