"""The input_dist schedules (`SCHEDULES`; docs/reference.md, "Schedules"), the input all-to-alls' own
process groups (`InputDistGroups`) and the default schedule's watch (`ScheduleWatch`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from pipeline.stages.watch import FINAL, StepWatch, WaitClock
from rewrite import kjt_all_to_alls

__all__ = [
    "NOT_ON_NCCL",
    "ONE_RANK",
    "SCHEDULES",
    "WATCH_ADVICE",
    "InputDistGroups",
    "Schedule",
    "ScheduleWatch",
    "backend_on",
    "made_like",
    "schedule_words",
]


@dataclass(frozen=True, slots=True)
class Schedule:
    """One input_dist schedule (results are bit for bit the same under each)."""

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


ONE_RANK = "one rank: the input all-to-alls move nothing, so every schedule does the same work"
"""Why a one-rank pipeline keeps torchrec's order without watching."""
NOT_ON_NCCL = (
    "the watch's figure (the host's time blocked on the input all-to-alls) has not been measured on "
    "NCCL, where a wait blocks a stream rather than the host; pin InputDistOptions(schedule='early') to "
    "try the other order"
)
"""Why the schedule watch keeps torchrec's order on NCCL."""
WATCH_ADVICE = "Give every rank the same ScheduleWatch and PrefetchWatch settings (or none)."
"""What to do where the ranks' live watches have different settings."""


def schedule_words(name: str) -> str:
    """`name` and what it does, e.g. "early (splits before forward, own process group)"."""
    if name == "late":
        return "late (torchrec's order)"
    schedule = SCHEDULES[name]
    when = "before" if schedule.early_splits else "after"
    group = "own process group" if schedule.own_group else "torchrec's process group"
    return f"{name} (splits {when} forward, {group})"


# -- the default: the schedule watch -------------------------------------------------------------


class ScheduleWatch(StepWatch):
    """The default schedule's watch: "late" until the training thread is blocked (input all-to-alls'
    waits, off the CPU in backward) for `threshold` of the step, steadily; then "early", kept where
    verified faster. Args: `pipeline.stages.watch.StepWatch`'s, but `threshold` 0.25."""

    modes: ClassVar[tuple[str, str]] = ("late", "early")
    label: ClassVar[str] = "input_dist schedule"

    def __init__(self, *, threshold: float = 0.25, **settings: Any) -> None:
        super().__init__(threshold=threshold, **settings)
        self.waits = WaitClock(self.clock)
        """Where the input_dist waits are timed (`active_clock`)."""

    @property
    def schedule(self) -> str:
        """The schedule in use."""
        return self.mode

    def _parts(self) -> tuple[float, float]:
        # the clock times only the thread that steps
        waits = self.waits
        waits.thread = threading.get_ident()
        parts = (waits.waited, waits.idle)
        waits.waited = waits.idle = 0.0
        return parts

    @property
    def active_clock(self) -> WaitClock | None:
        """The clock the input_dist waits report to, while the watch still watches or tries."""
        return None if self.phase in FINAL else self.waits

    @property
    def parts(self) -> tuple[float, float] | None:
        """Of `share`, this rank's median share in the waits and off the CPU in backward (or None)."""
        if len(self._samples) < self.window:
            return None
        return self.median_part(0), self.median_part(1)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "schedule": self.mode}

    def __repr__(self) -> str:
        """What `print(pipe.tuner)` shows."""
        head = f"input_dist schedule: adaptive, running {schedule_words(self.schedule)}"
        watched = "the training thread is blocked (input all-to-alls' waits, off the CPU in backward)"
        return self._described(head, watched, "batches", "under early")

    def _switched_text(self, share: float, clear: bool) -> str:
        waits, idle = self.parts or (0.0, 0.0)
        return (
            f"the training thread was blocked {share:.0%} of the step (median over {self.window} steps, "
            f"mean over {len(self.shares)} ranks: {self._shares_text()}; this rank {waits:.0%} in the input "
            f"all-to-alls' waits and {idle:.0%} off the CPU in backward; {self._held_text(clear)}): "
            f"trying {schedule_words('early')} from the next step, its all-to-alls on a process group "
            "of their own ('pipeline_input_dist', created then; on NCCL one more communicator); it is "
            f"verified over {self._verified_text()}"
        )

    def _verdict_head(self, *, kept: bool) -> str:
        if kept:
            return f"kept {schedule_words('early')}: the step under it over the step before"
        return (
            f"back to {schedule_words('late')} from the next step: the step under early over the step before"
        )

    def _pinned_text(self, reason: str) -> str:
        return f"kept {schedule_words('late')}: {reason}"


# -- the input all-to-alls' own process groups ----------------------------------------------------


def backend_on(pg: dist.ProcessGroup, device: torch.device) -> str:
    """The backend ("gloo", "nccl", ...) that `pg` runs collectives of tensors on `device` with; a
    mixed group ("cpu:gloo,cuda:nccl") has one per device type."""
    config = str(dist.get_backend_config(pg))
    for part in config.split(","):
        kind, named, backend = part.partition(":")
        if not named:
            return kind.strip()
        if kind.strip() == device.type:
            return backend.strip()
    return str(dist.get_backend(pg))


def made_like(pg: dist.ProcessGroup) -> dict[str, Any]:
    """The `dist.new_group` keywords that make a group as `pg` was made: backend, timeout and, on NCCL,
    a copy of its options (torch writes the new group's name and ranks into them, so never `pg`'s own)."""
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
    """The input all-to-alls' own process groups, one per whole-world group they run on (subgroups
    keep sharing: a copy would need every rank to know every other's subgroups). Each is made like
    its original (`made_like`) when the schedule first moves the all-to-alls, which every rank does
    at the same batch; on NCCL it is one more communicator, with buffers on every GPU.

    Args:
        new_group: creates a group (the ranks' protocol's does not wait for a peer that failed).
        note: told, in a sentence, when a group is made or destroyed (the rewrite report's notes).
        destroy: destroys a group.
    """

    def __init__(
        self,
        new_group: Callable[..., Any] = dist.new_group,
        note: Callable[[str], None] | None = None,
        destroy: Callable[[Any], None] = dist.destroy_process_group,
    ) -> None:
        self._new_group, self._destroy_group = new_group, destroy
        self.note = note
        self._made: list[tuple[dist.ProcessGroup, dist.ProcessGroup]] = []
        self._undo: Callable[[], None] | None = None
        """Moves the all-to-alls back, while they are on their own groups (`place`)."""
        self._retire_at: int | None = None
        """The batch at whose start the groups moved back from are destroyed (`place`)."""
        self._batch = 0
        """The batch being placed (what the notes name)."""
        self.on_own: bool | None = False
        """The all-to-alls are on their own groups (True) or on torchrec's with none to destroy (False):
        `place(own)` with this `own` has nothing to do. None: a destruction is due."""

    def place(self, own: bool, modules: list[Any], batch: int) -> None:
        """At the start of `batch`, on every rank alike: the pipelined `modules`' input all-to-alls on
        their own groups (`own`) or on torchrec's."""
        self._batch = batch
        if own and self._undo is None:
            self._retire_at = None
            self._undo = self.install([pm.module for pm in modules])
        elif not own and self._undo is not None:
            self.restore()
            # batches started on them may be in flight (up to three): destroyed once past forward
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
        self.on_own = True if self._undo is not None else (False if self._retire_at is None else None)

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

    def uncopyable(self, groups: list[dist.ProcessGroup]) -> str | None:
        """Why no group could be made like one of `groups` (`made_like` reads torch's private fields),
        or None; the same on every rank. Ask before the schedule may move, so the move cannot fail."""
        for pg in groups:
            if pg.size() == dist.get_world_size():
                try:
                    made_like(pg)
                except (AttributeError, RuntimeError, TypeError) as e:
                    return f"{type(e).__name__}: {e}"
        return None

    def _destroy(self) -> None:
        made, self._made = self._made, []
        for _, own in made:
            self._destroy_group(own)
        if made:
            self._say(f"input_dist, batch {self._batch}: destroyed the input all-to-alls' own process group")

    def close(self) -> None:
        """The all-to-alls back on torchrec's groups and their own destroyed; only with no batch in flight."""
        self.restore()
        self._retire_at = None
        self._destroy()
        self._rest()

    def _say(self, text: str) -> None:
        if self.note is not None:
            self.note(text)

    def install(self, modules: list[nn.Module]) -> Callable[[], None]:
        """Move the modules' KJT all-to-alls to their own groups (collectives already issued keep theirs);
        returns the undo function."""
        moved = []
        for a2a in (a for m in modules for a in kjt_all_to_alls(m)):
            moved.append((a2a, a2a._pg))
            a2a._pg = self.own_group(a2a._pg)

        def undo() -> None:
            for a2a, pg in reversed(moved):
                a2a._pg = pg

        return undo

    def current(self, pg: Any) -> Any:
        """The group the all-to-alls of `pg` use now: its twin while they are moved, else the original."""
        for original, own in self._made:
            if pg is original or pg is own:
                return own if self._undo is not None else original
        return pg
