"""`InputDistGroups`: the process groups reserved for the input all-to-alls, so that backward's
collectives do not queue behind them (the schedules with `own_group`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rewrite import kjt_all_to_alls

__all__ = ["InputDistGroups", "made_like"]


def made_like(pg: dist.ProcessGroup) -> dict[str, Any]:
    """The `dist.new_group` keywords that make a group as `pg` was made: its backend, its timeout
    and, on NCCL, a copy of its options (high-priority streams, the communicator's config; torch
    writes the new group's name and ranks into the options it is given, so `pg`'s own are not)."""
    backend = dist.get_backend(pg)
    device = torch.device("cuda" if "nccl" in str(backend) else "cpu")
    options = pg._get_backend(device).options
    made: dict[str, Any] = {"backend": backend, "timeout": options._timeout}
    if hasattr(options, "is_high_priority_stream"):  # NCCL's options
        copy = type(options)()
        copy.is_high_priority_stream = options.is_high_priority_stream
        copy.config = options.config
        made["pg_options"] = copy
    return made


class InputDistGroups:
    """Process groups reserved for the input all-to-alls, one per group they were created on.

    A process group runs its collectives in the order they were issued. The pipeline issues the
    values all-to-all of batch i+1 before the backward of batch i, so on a shared group backward's
    embedding all-to-all and DDP's all-reduce would queue behind it. On a group of its own it runs
    alongside them. Each group is made like the one it copies (`made_like`: its backend, timeout and
    options), when the schedule first moves the all-to-alls (all ranks reach `place` at the same
    batch: the schedule changes at a step every rank decides alike), and said in `note`. When the
    schedule moves them back, the group is destroyed at the third batch start after that, once the
    batches started on it have been through forward (an undo by `detach` keeps it: batches in
    flight may still use it).

    Only groups spanning every rank get their own: creating a copy of a subgroup would need every
    rank to know every other rank's subgroups. Subgroups keep sharing.
    The cost is one more communicator per group: on NCCL, its buffers on every GPU.

    Args:
        new_group: creates a group (`dist.new_group`, or the ranks' protocol's, which does not wait
            for a peer that failed).
        note: told, in a sentence, when a group is made or destroyed (the rewrite report's notes).
    """

    def __init__(
        self, new_group: Callable[..., Any] = dist.new_group, note: Callable[[str], None] | None = None
    ) -> None:
        self._new_group = new_group
        self.note = note
        self._made: list[tuple[dist.ProcessGroup, dist.ProcessGroup]] = []
        self._undo: Callable[[], None] | None = None
        """Moves the all-to-alls back, while they are on their own groups (`place`)."""
        self._retire_at: int | None = None
        """The batch at whose start the groups moved back from are destroyed (`place`)."""
        self._batch = 0
        """The batch being placed (what the notes name)."""
        self.at_rest: bool | None = False
        """`place(own)` with this `own` has nothing to do (None: a retirement is due); the caller
        may skip the call."""

    def place(self, own: bool, modules: list[Any], batch: int) -> None:
        """At the start of `batch`: the pipelined `modules`' input all-to-alls on their own groups
        (`own`) or on torchrec's."""
        self._batch = batch
        if own and self._undo is None:
            self._retire_at = None
            self._undo = self.install([pm.module for pm in modules])
        elif not own and self._undo is not None:
            self.restore()
            # Batches started on them may be in flight (one to three, by class): destroyed at the
            # third start from now, after they have all been through forward.
            self._retire_at = batch + 3
        elif not own and self._retire_at is not None and batch >= self._retire_at:
            self._retire_at = None
            self._destroy()
        self._rest()

    def restore(self) -> None:
        """The input all-to-alls back on torchrec's groups (their own groups are kept)."""
        if self._undo is not None:
            self._undo()
            self._undo = None
            self._rest()

    def _rest(self) -> None:
        """`at_rest` from the state: on their own groups, on torchrec's, or a retirement due."""
        self.at_rest = True if self._undo is not None else (False if self._retire_at is None else None)

    def own_group(self, pg: dist.ProcessGroup) -> dist.ProcessGroup:
        """The group reserved for all-to-alls originally on `pg` (`pg` itself for subgroups)."""
        for original, own in self._made:
            if original is pg or own is pg:
                return own
        if pg.size() != dist.get_world_size():
            return pg
        made = made_like(pg)
        own = self._new_group(**made, group_desc="pipeline_input_dist")
        self._made.append((pg, own))
        self._say(
            f"input_dist, batch {self._batch}: made a {made['backend']} process group of its own for the "
            f"input all-to-alls (timeout {made['timeout']}, as the job's); on NCCL, a second "
            "communicator and its buffers on every GPU"
        )
        return own

    def _destroy(self) -> None:
        made, self._made = self._made, []
        for _, own in made:
            dist.destroy_process_group(own)
        if made:
            self._say(f"input_dist, batch {self._batch}: destroyed the input all-to-alls' own process group")

    def _say(self, text: str) -> None:
        if self.note is not None:
            self.note(text)

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
