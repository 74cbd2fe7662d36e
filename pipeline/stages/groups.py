"""`InputDistGroups`: the process groups reserved for the input all-to-alls, so that backward's
collectives do not queue behind them (the schedules with `own_group`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import nn

from rewrite import kjt_all_to_alls

__all__ = ["InputDistGroups"]


class InputDistGroups:
    """Process groups reserved for the input all-to-alls, one per group they were created on.

    A process group runs its collectives in the order they were issued. The pipeline issues the
    values all-to-all of batch i+1 before the backward of batch i, so on a shared group backward's
    embedding all-to-all and DDP's all-reduce would queue behind it. On a group of its own it runs
    alongside them. Each group is created once (all ranks must reach `install` at the same point of
    the schedule, which the pipelines guarantee) and reused when the all-to-alls move again.

    Only groups spanning every rank get their own: creating a copy of a subgroup would need every
    rank to know every other rank's subgroups. Subgroups keep sharing.
    The cost is one more communicator per group: on NCCL, its buffers on every GPU.
    """

    def __init__(self, new_group: Callable[..., Any] = dist.new_group) -> None:
        self._new_group = new_group
        self._made: list[tuple[dist.ProcessGroup, dist.ProcessGroup]] = []
        self._undo: Callable[[], None] | None = None
        """Moves the all-to-alls back, while they are on their own groups (`place`)."""

    def place(self, own: bool, modules: list[Any]) -> None:
        """The pipelined `modules`' input all-to-alls on their own groups (`own`) or on torchrec's."""
        if own and self._undo is None:
            self._undo = self.install([pm.module for pm in modules])
        elif not own:
            self.restore()

    def restore(self) -> None:
        """The input all-to-alls back on torchrec's groups."""
        if self._undo is not None:
            self._undo()
            self._undo = None

    def own_group(self, pg: dist.ProcessGroup) -> dist.ProcessGroup:
        """The group reserved for all-to-alls originally on `pg` (`pg` itself for subgroups)."""
        for original, own in self._made:
            if original is pg or own is pg:
                return own
        if pg.size() != dist.get_world_size():
            return pg
        own = self._new_group(backend=dist.get_backend(pg), group_desc="pipeline_input_dist")
        self._made.append((pg, own))
        return own

    def install(self, modules: list[nn.Module]) -> Callable[[], None]:
        """Move the modules' KJT all-to-alls to their own groups; returns the undo function.

        Collectives already issued keep the group they were issued on."""
        moved = []
        for a2a in (a for m in modules for a in kjt_all_to_alls(m)):
            moved.append((a2a, a2a._pg))
            a2a._pg = self.own_group(a2a._pg)

        def undo() -> None:
            for a2a, pg in reversed(moved):
                a2a._pg = pg

        return undo

    def current(self, pg: Any) -> Any:
        """The group that the all-to-alls made on (or moved to) `pg` use now: its own twin while
        they are moved (`place`), else the original."""
        for original, own in self._made:
            if pg is original or pg is own:
                return own if self._undo is not None else original
        return pg
