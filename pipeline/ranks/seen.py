"""Hooks that report the input all-to-alls over every rank run inside the model's own forward.

TrainPipelineBase has no input_dist of its own, so the collectives over every rank in its step are
inside the model: a sharded module's input all-to-all. A forward pre-hook on each sharded module
whose process group spans the world reports it issued, and a forward hook reports it completed (the
module waited for it before it computed), to the ranks' protocol (`Ranks.world_collective_issued`
and `world_collective_completed`).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from rewrite import outermost_sharded

if TYPE_CHECKING:
    from pipeline.ranks.protocol import Ranks

__all__ = ["WorldCollectiveHooks", "backward_spans_world", "spans_world"]


class WorldCollectiveHooks:
    """Forward hooks on the model's sharded modules whose input all-to-all spans every rank.

    `remove()` takes the hooks off the model again.
    """

    def __init__(self, model: torch.nn.Module, ranks: Ranks) -> None:
        # weakly: the model holds the hooks, and must not keep a dropped pipeline's ranks alive
        self._ranks = weakref.ref(ranks)
        self._mark: Any = None
        world = dist.get_world_size()
        modules = [m for m in outermost_sharded(model).values() if spans_world(m, world)]
        self._hooks = [m.register_forward_pre_hook(self._issued) for m in modules]
        self._hooks += [m.register_forward_hook(self._completed) for m in modules]

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _issued(self, *_: Any) -> None:
        ranks = self._ranks()
        self._mark = ranks.world_collective_issued() if ranks is not None else None

    def _completed(self, *_: Any) -> None:
        mark, self._mark = self._mark, None
        ranks = self._ranks()
        if ranks is not None:
            ranks.world_collective_completed(mark)


def spans_world(module: torch.nn.Module, world: int) -> bool:
    """The sharded module's input all-to-all spans `world` ranks: its sharding's process group (a 2D
    sharding's is `sharding_pg`) has them all, and some table is not data-parallel (whose input_dist
    moves nothing). Unknown attributes (another kind of sharded module) answer False."""
    env = getattr(module, "_env", None)
    group = getattr(env, "sharding_pg", None) or getattr(env, "process_group", None)
    kinds = getattr(module, "_sharding_types", None) or []
    return group is not None and group.size() == world and any(k != "data_parallel" for k in kinds)


def backward_spans_world(model: torch.nn.Module) -> bool:
    """Backward of `model` runs a collective over every rank, completed when it returns on CPU: the
    backward of the pooled-embedding all-to-all of a sharded module whose input all-to-all spans
    every rank. (DDP's all-reduce does not count: `no_sync()` skips it.)"""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    world = dist.get_world_size()
    return any(spans_world(m, world) for m in outermost_sharded(model).values())
