"""`Ranks`: the one owner of the ranks' agreement on every batch, before it enters a collective.

Every rank has a status for every batch position it fetches (`Status`), recorded in the batch's
`Ticket`, whose sequence number is the same on every rank. The ranks learn each other's statuses
before the batch's first collective (`admit`), in one of two ways, chosen there from that number:

- store flags (`pipeline.ranks.flags`): a rank whose status is not HAVE writes it at fetch, and a
  peer reads the flags once it completed a collective over every rank that was issued after the
  batch was fetched (the one cross-rank rule, `world_collective_completed`);
- a vote (`pipeline.ranks.votes`) where no such collective has completed yet: a lane's first
  batches, and every batch looked ahead under `execute_all_batches=False`.

Every rank takes the same way for the same batch, since the collectives come in the same order on
every rank. The stages report their collectives over every rank (`world_collective_issued`, then
`world_collective_completed`); no caller places the rule itself.

So uneven data ends on every rank at the shortest rank's count, a batch with wrong keys or a
malformed KeyedJaggedTensor stops every rank with the same error, and a rank that raises makes its
peers stop within seconds (`pipeline.ranks.failure`). A rank whose dataloader is exhausted keeps
adding placeholders (no batch) until the end is agreed, so every rank holds as many batches in
flight and issues the same collectives in order.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipeline.config import RankOptions
from pipeline.ranks.failure import FailureSignal, PeerFailedError, is_comm_error
from pipeline.ranks.flags import StoreFlags
from pipeline.ranks.keys import KeyCheck
from pipeline.ranks.kjt_check import KJTCheck
from pipeline.ranks.lane import Lane, LaneState, Ticket
from pipeline.ranks.seen import WorldCollectiveHooks
from pipeline.ranks.status import (
    BatchKeysError,
    MalformedBatchError,
    RewriteMismatchError,
    Status,
    UnevenDataError,
    keys_message,
    malformed_message,
    uneven_message,
    warn_untrained,
)
from pipeline.ranks.votes import Votes

__all__ = ["Ranks", "WorldMark"]

_PIPELINE_IDS = itertools.count()
"""Numbers pipelines in construction order, the same on every rank (names the store keys)."""
_GROUP_IDS = itertools.count()
"""Numbers the process groups the pipelines create, in order (the same order on every rank)."""


@dataclass(frozen=True, slots=True)
class WorldMark:
    """A collective over every rank, issued after the batches of `lane` up to sequence number
    `through` were fetched."""

    lane: Lane
    through: int


class Ranks:
    """Fetch, admission and failure across ranks, for one pipeline.

    Args:
        options: how the ranks agree (`RankOptions`).
        model: the model trained (its embedding tables bound the ids `check_kjts` accepts).
        next_batch: takes the next batch from an iterator, None at its end (a pipeline's
            `_next_batch`, which a subclass may override); by default `next(iterator, None)`.
    """

    def __init__(
        self,
        options: RankOptions,
        *,
        model: torch.nn.Module | None = None,
        next_batch: Callable[[Any], Any] | None = None,
    ) -> None:
        self._options = options
        self._next_batch: Callable[[Any], Any] = next_batch or _next_or_none
        self.keys = KeyCheck() if options.check_keys else None
        self.kjts = KJTCheck(model) if options.check_kjts else None
        self._votes = Votes(timeout=options.peer_timeout, new_group=self.new_group)
        self.voting = options.agreement and self._votes.distributed
        """Ranks agree on every batch (else a rank's own status is all it knows)."""
        self._pipeline_id = next(_PIPELINE_IDS)  # the same on every rank: pipelines are built in step
        self._failure = FailureSignal(grace=options.failure_grace, scope=f"p{self._pipeline_id}/")
        self._lane_count = 0
        self._lane: Lane | None = None
        """The lane whose step runs now (`enter`): the collectives issued belong to its batches."""
        self._hooks: WorldCollectiveHooks | None = None
        self.untrained_batches: list[Any] = []
        """Batches this rank fetched but did not train because another rank's data ended first."""
        self.votes = 0
        """Batches admitted by a vote (the rest by flags): a lane's first batches, and batches
        looked ahead under `execute_all_batches=False`."""

    def new_group(self, **kwargs: Any) -> dist.ProcessGroup:
        """`dist.new_group(**kwargs)`, entered only once every rank reached it.

        Every rank must create the pipeline's process groups at the same point, but a rank whose
        dataloader raised never gets there, and `dist.new_group` would wait for it for the store's
        timeout (300 s). A rendezvous in the store first, which stops at a peer's failure
        (`FailureSignal.rendezvous`), keeps that wait to a few milliseconds.

        Raises:
            PeerFailedError: a peer failed before reaching it (or none came within `peer_timeout`).
        """
        timeout = self._options.peer_timeout.total_seconds()
        self._failure.rendezvous(f"group{next(_GROUP_IDS)}", timeout)
        return dist.new_group(**kwargs)

    def open_lane(self, iterator: Any) -> Lane:
        """A new lane for `iterator` (lanes are opened by lockstep `progress()` calls)."""
        lane = Lane(iterator)
        self._lane_count += 1
        store = self._failure.store
        if self.voting and store is not None:
            lane.flags = StoreFlags(store, f"trainpipeline/p{self._pipeline_id}/lane{self._lane_count}")
        return lane

    def fetch(self, lane: Lane) -> tuple[Any, Ticket] | None:
        """Take the next batch of `lane` and publish this rank's status for it.

        Returns:
            `(batch, ticket)`, with batch None for a placeholder (this rank's data ended, the
            others' may not have); None when nothing is to be added.
        """
        if not lane.fetching:
            return None
        batch, status = None, Status.EXHAUSTED
        if lane.state is LaneState.OPEN:
            try:
                batch = self._next_batch(lane.iterator)
            except StopIteration:  # an override of `_next_batch` that calls next() itself
                batch = None
            if batch is None:
                lane.state = LaneState.EXHAUSTED
            else:
                status = Status.HAVE
        if status == Status.EXHAUSTED and not self.voting:
            return None
        ticket = Ticket(seq=lane.enqueued, position=lane.fetched, status=status)
        if status == Status.HAVE:
            lane.fetched += 1
            if self.keys is not None and (found := self.keys.check(batch)) is not None:
                ticket.status, ticket.found_keys = Status.BAD_KEYS, found
            elif self.kjts is not None and (problem := self.kjts.check(batch)) is not None:
                ticket.status, ticket.problem = Status.MALFORMED, problem
        if self.voting and lane.flags is not None:
            if ticket.status in (Status.BAD_KEYS, Status.MALFORMED) or (
                ticket.status == Status.EXHAUSTED and not lane.flags.end_raised
            ):
                lane.flags.raise_flag(ticket.status, ticket.position)
        lane.enqueued += 1
        return batch, ticket

    def admit(self, lane: Lane, ctx: Any) -> bool:
        """Learn every rank's status for `ctx`'s batch; call before its first collective.

        Returns:
            True: every rank has it. False: some rank's data ended there; `ctx` and everything
            after it are dropped from the lane on every rank, and the lane is ENDED.

        Raises:
            BatchKeysError: some rank's batch has the wrong keys (on every rank).
            MalformedBatchError: some rank's batch has a malformed KeyedJaggedTensor (on every rank).
            UnevenDataError: the data ended unevenly and `on_uneven="error"` (on every rank).
        """
        ticket: Ticket = ctx.ticket
        if ticket.admitted:
            return True
        statuses = self._statuses(lane, ctx)
        if all(s == Status.HAVE for s in statuses):
            ticket.admitted = True
            return True
        if Status.BAD_KEYS in statuses or Status.MALFORMED in statuses:
            mine = (self._failure.rank, ticket.position, ticket.found_keys, ticket.problem)
            details = self._votes.gather(mine) if self.voting else [mine]
            if Status.BAD_KEYS in statuses:
                raise BatchKeysError(keys_message(details, self.keys.expected if self.keys else None))
            raise MalformedBatchError(malformed_message(details))
        dropped = list(lane.inflight)[lane.inflight.index(ctx) :]
        for _ in dropped:
            lane.inflight.pop()
        lane.state = LaneState.ENDED
        if all(s == Status.EXHAUSTED for s in statuses):
            return False  # every rank ended here: even data
        if self._options.on_uneven == "error":
            raise UnevenDataError(uneven_message(statuses, ticket.position))
        untrained = [c.batch for c in dropped if c.ticket.status != Status.EXHAUSTED]
        if untrained:
            self.untrained_batches.extend(untrained)
            warn_untrained(self._failure.rank, len(untrained), statuses, ticket.position)
        return False

    def _statuses(self, lane: Lane, ctx: Any) -> list[Status]:
        ticket: Ticket = ctx.ticket
        if not self.voting:
            return [ticket.status]
        if lane.flags is not None and ticket.seq <= lane.readable_through:
            statuses = lane.flags.statuses(ticket.position, self._failure.world, ticket.seq)
            statuses[self._failure.rank] = ticket.status
            return statuses
        self.votes += 1
        return self._votes.vote(ticket.status).wait()

    def agree_on(self, what: str, text: str) -> None:
        """Check that every rank has the same `text` (once, before a collective that depends on it).

        Raises:
            RewriteMismatchError: on every rank, naming the ranks whose `text` differs.
        """
        if not self.voting:
            return
        texts = self._votes.gather(text)
        if len(set(texts)) > 1:
            shown = "\n".join(f"  rank {r}:\n    " + t.replace("\n", "\n    ") for r, t in enumerate(texts))
            raise RewriteMismatchError(
                f"the ranks found different {what}, so their input all-to-alls would not match:\n"
                f"{shown}\nMake the model's calls of its sharded modules the same on every rank "
                "(no branch on batch data before them), or give explicit arg_paths."
            )

    # -- the one cross-rank rule --------------------------------------------------------------

    def enter(self, lane: Lane) -> None:
        """A step of `lane` starts: the collectives reported until the next `enter` are its."""
        self._lane = lane

    @property
    def lane(self) -> Lane | None:
        """The lane whose step runs now (the last `enter`), None before the first."""
        return self._lane

    def world_collective_issued(self) -> WorldMark | None:
        """Call right after issuing a collective over every rank (on every rank, in the same
        order); pass what it returns to `world_collective_completed` once it completed."""
        lane = self._lane
        if lane is None or lane.flags is None:
            return None
        return WorldMark(lane, lane.enqueued - 1)

    def world_collective_completed(self, mark: WorldMark | None) -> None:
        """This rank completed the collective `mark` names: the peers' flags of every batch
        fetched before it was issued are in the store, so they may be read, from now on, and the
        read starts in the background if a batch waits for it.

        This is the one cross-rank rule: a rank reads another rank's flags for a batch only after
        a collective over every rank that every rank issued after fetching that batch. A rank
        raises its flag at fetch, before it issues that collective, and no rank completes a
        collective before every rank issued it, so the read cannot miss the flag. `admit` takes
        the flags for a batch whose sequence number the rule covers, and votes on any other.
        """
        if mark is None or mark.through <= mark.lane.readable_through:
            return
        lane = mark.lane
        lane.readable_through = mark.through
        waiting = any(not c.ticket.admitted and c.ticket.seq <= mark.through for c in lane.inflight)
        if waiting and lane.flags is not None:
            lane.flags.read_in_background(mark.through)

    def report_forward_collectives(self, model: torch.nn.Module) -> None:
        """Report the input all-to-alls over every rank that the model's own sharded modules run
        inside forward (pipelines that leave the sharded modules' forward as it is: Base)."""
        if self._hooks is None and self.voting:
            self._hooks = WorldCollectiveHooks(model, self)
            # the model outlives the pipeline: a pipeline per epoch must not pile hooks up on it
            weakref.finalize(self, self._hooks.remove)

    def fail(self, error: BaseException, reset: Callable[[], None]) -> None:
        """This rank raised inside `progress()`: `reset()` the batches in flight and, across ranks,
        make sure no peer is left waiting (`abort_on_error`).

        Raises:
            PeerFailedError: the error came from a peer's failure (a collective broken by it).
        """
        signal = self._failure
        if not (self._options.abort_on_error and signal.distributed):
            reset()
            return
        if is_comm_error(error):
            peers = signal.peer_failures()
            try:
                reset()
            finally:
                signal.abort()
            cause = "; ".join(peers) or "no rank recorded an error: a peer was probably killed or exited"
            raise PeerFailedError(
                f"rank {signal.rank} stopped because a peer failed ({cause}). This rank's process "
                "groups were destroyed; restart the job."
            ) from error
        signal.announce(error)
        every_rank_failed = signal.all_failed()
        signal.next_generation()
        try:
            reset()
        finally:
            if not every_rank_failed:  # a peer may be waiting in a collective for this rank
                signal.abort()


def _next_or_none(iterator: Any) -> Any:
    return next(iterator, None)
