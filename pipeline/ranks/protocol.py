"""`Ranks`, the one owner of the ranks' agreement on every batch before it enters a collective
(docs/architecture.md, "Where the cross-rank rules live"): each rank's `Status` for each batch, in
its `Ticket`, learnt by every rank from the splits all-to-all it rides on or from a vote (`Votes`);
the batches in flight per dataloader iterator (`Lane`); and the loader's state before each fetch."""

from __future__ import annotations

import enum
import itertools
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from pipeline.options import RankOptions
from pipeline.ranks.failure import CollectiveFailed, FailureSignal, rank_and_world
from pipeline.ranks.kjt_check import KeyCheck, KJTCheck

__all__ = [
    "AgreedError",
    "BatchKeysError",
    "Lane",
    "LaneState",
    "MalformedBatchError",
    "OwnedGroups",
    "Ranks",
    "RewriteMismatchError",
    "RidingMismatchError",
    "StatefulIterator",
    "Status",
    "Ticket",
    "UnevenDataError",
    "Vote",
    "Votes",
    "resume_state",
]


class Status(enum.IntEnum):
    """One rank's status for one batch position (an int, so that a vote can sum it in a tensor)."""

    EXHAUSTED = 0
    """This rank's dataloader has no batch at this position (nor after it)."""
    HAVE = 1
    """This rank has the batch."""
    BAD_KEYS = 2
    """This rank has the batch, but its KeyedJaggedTensor keys differ from the first batch's."""
    MALFORMED = 3
    """This rank has the batch, but one of its KeyedJaggedTensors is malformed (lengths that do not
    sum to the values, a negative length, an id outside its table's rows)."""


class AgreedError(RuntimeError):
    """Raised on every rank at the same step: the process group is still usable."""


class UnevenDataError(AgreedError):
    """`on_uneven="error"`: the ranks' dataloaders hold different numbers of batches."""


class BatchKeysError(AgreedError, ValueError):
    """A batch's KeyedJaggedTensor keys differ from those the model was sharded for."""


class RewriteMismatchError(AgreedError):
    """The ranks found different call sites or programs for the sharded modules: their input
    all-to-alls would not match."""


class RidingMismatchError(AgreedError):
    """The row read as a rank's status for a batch is not a status word: the ranks' fused splits
    all-to-alls do not match."""


class MalformedBatchError(AgreedError, ValueError):
    """A batch's KeyedJaggedTensor is malformed (`pipeline.ranks.kjt_check`)."""


def _show(keys: list[tuple[str, list[str]]]) -> str:
    return ", ".join(f"{found} at {path or 'the batch'}" for path, found in keys) or "no KeyedJaggedTensor"


class LaneState(enum.Enum):
    """Where a lane's iterator stands; only `OPEN` and `EXHAUSTED` fetch."""

    OPEN = "open"
    """Batches are taken from the iterator."""
    EXHAUSTED = "exhausted"
    """This rank's iterator raised StopIteration; across ranks, placeholders (no batch) are added
    until every rank agrees that the data ended, since other ranks may still have batches."""
    DRAINING = "draining"
    """`drain()`: the batches in flight run, nothing is fetched."""
    ENDED = "ended"
    """Every rank agreed that the data ended: nothing more is fetched."""


@dataclass(slots=True, eq=False)
class Ticket:
    """What the ranks' protocol records for one batch this rank fetched (or a placeholder)."""

    position: int
    """Index of the batch in its dataloader (the same position on every rank)."""
    status: Status
    """This rank's status for the batch (written at fetch)."""
    vote: Vote | None = None
    """How many ranks have each status for this batch (started at fetch; None with one rank or
    `agreement=False`)."""
    carried: bool = False
    """No vote was started at fetch: the status rides on the batch's splits all-to-all (the
    input dist's `StatusSplits`), or, if the batch's first collective is another, is voted then."""
    found_keys: Any = None
    """The keys the batch has, when the key check failed."""
    problem: str | None = None
    """What is wrong with the batch's KeyedJaggedTensors, when that check failed."""
    admitted: bool = False
    """Every rank has the batch: it may enter collectives."""


@dataclass(eq=False)
class Lane:
    """The batches in flight from one dataloader iterator (contexts, oldest first)."""

    iterator: Iterator[Any]
    inflight: deque[Any] = field(default_factory=deque)
    state: LaneState = LaneState.OPEN
    fetched: int = 0
    """Batches taken from the iterator so far."""
    tickets: int = 0
    """Batches and placeholders fetched so far (the same count on every rank)."""
    steps: int = 0
    """Batches of this iterator run so far."""
    iterator_state: Callable[[], Any] | None = field(init=False)
    """The iterator's `state_dict`, read before each fetch (a no-drain checkpoint resumes from there);
    None if it keeps no state."""

    def __post_init__(self) -> None:
        self.iterator_state = getattr(self.iterator, "state_dict", None)

    def drain(self) -> None:
        """Fetch nothing more; what is in flight still runs."""
        if self.state is not LaneState.ENDED:
            self.state = LaneState.DRAINING


_BITS = 16
"""Bits of one status's count in the vote's int64."""
_MAX_WORLD = (1 << (_BITS - 1)) - 1
"""The top field must not reach the sign bit."""


@dataclass(eq=False)
class Vote:
    """One batch's vote: `wait()` returns, per `Status`, how many ranks have it."""

    work: Any
    tensor: torch.Tensor
    counts: dict[Status, int] | None = None

    def wait(self) -> dict[Status, int]:
        """Per `Status`, how many ranks have it; `CollectiveFailed` where a peer left or timed out."""
        if self.counts is None:
            if self.work is not None:
                try:
                    self.work.wait()
                except RuntimeError as e:
                    raise CollectiveFailed(f"the ranks' vote on a batch failed: {e}") from e
            packed = int(self.tensor.item())
            mask = (1 << _BITS) - 1
            self.counts = {s: (packed >> (_BITS * i)) & mask for i, s in enumerate(Status)}
        return self.counts


class Votes:
    """The votes, on a gloo group of its own (made at the first vote, on every rank), or local; a vote
    fails after `timeout`; `new_group` makes the group (`Ranks.new_group`: it stops at a peer's failure)."""

    def __init__(self, *, timeout: timedelta, new_group: Callable[..., Any] = dist.new_group) -> None:
        self._timeout = timeout
        self._new_group = new_group
        self._group: Any = None

    @property
    def distributed(self) -> bool:
        return rank_and_world()[1] > 1

    def vote(self, status: Status) -> Vote:
        """Start this rank's vote for the next batch; every rank calls it once per batch, in order."""
        tensor = torch.tensor([1 << (_BITS * status)], dtype=torch.int64)
        if not self.distributed:
            return Vote(None, tensor)
        if rank_and_world()[1] > _MAX_WORLD:
            raise RuntimeError(
                f"the ranks' vote counts up to {_MAX_WORLD} ranks; pass ranks=RankOptions(agreement=False)"
            )
        return Vote(dist.all_reduce(tensor, group=self._own_group(), async_op=True), tensor)

    def forget_group(self) -> None:
        """The group is about to be destroyed by its owner: the next vote makes another."""
        self._group = None

    def _own_group(self) -> Any:
        if self._group is None:
            self._group = self._new_group(backend="gloo", timeout=self._timeout)
        return self._group

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (a rare, blocking exchange, where every rank is at the same vote)."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj, group=self._own_group())
        return out


_GROUP_IDS = itertools.count()
"""Numbers the process groups the pipelines of this process create, in order of creation: every
rank creates them at the same step of the same `progress()` calls, as `dist.new_group` requires, so
the numbers (which name their rendezvous in the store) agree whatever order the pipelines were
built in."""


class OwnedGroups:
    """The process groups one pipeline made; holds nothing else, so that its finalizer may keep it."""

    def __init__(self) -> None:
        self._groups: list[dist.ProcessGroup] = []

    def add(self, group: dist.ProcessGroup) -> dist.ProcessGroup:
        self._groups.append(group)
        return group

    def destroy(self, group: dist.ProcessGroup) -> None:
        """Destroy `group` (local on gloo and NCCL: no rank waits for another)."""
        self._groups.remove(group)
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group(group)

    def destroy_all(self) -> None:
        while self._groups:
            self.destroy(self._groups[-1])

    def __len__(self) -> int:
        return len(self._groups)


class Ranks:
    """Fetch, admission and failure across ranks, for one pipeline. `model`'s embedding tables bound the
    ids `check_kjts` accepts; `next_batch` is the pipeline's `_next_batch` (None at the iterator's end)."""

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
        self._failure = FailureSignal(grace=options.failure_grace)
        self.groups = OwnedGroups()
        """The process groups this pipeline made (`new_group`), freed by `close()`."""
        self.untrained_batches: list[Any] = []
        """Batches this rank fetched but did not train because another rank's data ended first."""
        self.pending_votes: list[Vote] = []
        """Votes started since the last `wait_votes`."""
        self.votes = 0
        """Votes started (one per batch fetched, placeholders included, while `voting`, unless
        the batch's status rides on its splits all-to-all)."""
        self.carried = 0
        """Batches fetched whose status rides on their splits all-to-all instead of a vote (a batch
        counts in `votes` or here, never both)."""
        self.carrying = False
        """Set by the input dist while statuses can ride on the fused splits all-to-all: batches fetched
        meanwhile start no vote. Changed only at points every rank reaches in the same order."""

    def new_group(self, **kwargs: Any) -> dist.ProcessGroup:
        """`dist.new_group(**kwargs)` after a rendezvous in the store that stops at a peer's failure (a
        rank whose dataloader raised never comes, and `dist.new_group` would wait 300 s for it): raises
        `PeerFailedError` then, or where none came within `peer_timeout`."""
        timeout = self._options.peer_timeout.total_seconds()
        self._failure.rendezvous(f"group{next(_GROUP_IDS)}", timeout)
        return self.groups.add(dist.new_group(**kwargs))

    def fetch(self, lane: Lane) -> tuple[Any, Ticket] | None:
        """Take `lane`'s next batch and record this rank's status for it: `(batch, ticket)`, batch None
        for a placeholder (this rank's data ended, maybe not the others'); None when nothing is added."""
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
        elif lane.state is not LaneState.EXHAUSTED:  # draining or ended: nothing is fetched
            return None
        if status == Status.EXHAUSTED and not self.voting:
            return None
        ticket = Ticket(position=lane.fetched, status=status)
        if status == Status.HAVE:
            lane.fetched += 1
            if self.keys is not None and (found := self.keys.check(batch)) is not None:
                ticket.status, ticket.found_keys = Status.BAD_KEYS, found
            elif self.kjts is not None and (problem := self.kjts.check(batch)) is not None:
                ticket.status, ticket.problem = Status.MALFORMED, problem
        lane.tickets += 1
        if self.voting and self.carrying and lane.tickets > 1:  # a dataloader's first is voted on,
            ticket.carried = True  # so that `peer_timeout` bounds the wait for a peer that stopped
            self.carried += 1
        elif self.voting:  # every rank fetches in the same order, so the votes pair up
            self._vote(ticket)
        return batch, ticket

    def _vote(self, ticket: Ticket) -> None:
        ticket.vote = self._votes.vote(ticket.status)
        self.pending_votes.append(ticket.vote)
        self.votes += 1

    def admit(self, lane: Lane, ctx: Any) -> bool:
        """Learn every rank's status for `ctx`'s batch; call before its first collective. Returns True
        where every rank has it, False where some rank's data ended there (`ctx` and all after it are
        dropped from the lane on every rank, and the lane is ENDED). Raises, on every rank, `BatchKeysError`
        or `MalformedBatchError` where some rank's batch has wrong keys or is malformed, and
        `UnevenDataError` for uneven data under `on_uneven="error"`."""
        ticket: Ticket = ctx.ticket
        if ticket.admitted:
            return True
        if ticket.carried and ticket.vote is None:  # its first collective is not its splits: vote now
            self._vote(ticket)
            self.carried -= 1
        counts = ticket.vote.wait() if ticket.vote is not None else {ticket.status: 1}
        return self.admit_from_counts(lane, ctx, counts)

    def admit_from_counts(self, lane: Lane, ctx: Any, counts: dict[Status, int]) -> bool:
        """`admit` once every rank's status is known (`counts`: how many ranks have each); a riding batch
        every rank has is admitted by `Admission.read_statuses` alone."""
        ticket: Ticket = ctx.ticket
        world = sum(counts.values())
        if counts.get(Status.HAVE, 0) == world:
            ticket.admitted = True
            return True
        if counts.get(Status.BAD_KEYS, 0) or counts.get(Status.MALFORMED, 0):
            mine = (self._failure.rank, ticket.position, ticket.found_keys, ticket.problem)
            details = self._votes.gather(mine) if self.voting else [mine]  # every rank's
            if counts.get(Status.BAD_KEYS, 0):
                found = "; ".join(
                    f"batch {position} of rank {rank}'s dataloader has keys {_show(keys)}"
                    for rank, position, keys, _ in details
                    if keys is not None
                )
                expected = self.keys.expected if self.keys else None
                raise BatchKeysError(
                    f"{found}, but the model was sharded for {_show(expected or [])} (the keys of the "
                    "first batch). Every rank stopped before that batch. Fix the dataset (a feature renamed, "
                    "missing or added), or pass ranks=RankOptions(check_keys=False) if the keys legitimately "
                    "vary."
                )
            problems = "; ".join(
                f"batch {position} of rank {rank}'s dataloader: {problem}"
                for rank, position, _, problem in details
                if problem is not None
            )
            raise MalformedBatchError(
                f"{problems}. Every rank stopped before that batch entered a collective. Fix the dataset "
                "or its collate function, or pass ranks=RankOptions(check_kjts=False) to skip the check."
            )
        dropped = list(lane.inflight)[lane.inflight.index(ctx) :]
        for _ in dropped:
            lane.inflight.pop()
        lane.state = LaneState.ENDED
        if counts.get(Status.EXHAUSTED, 0) == world:
            return False  # every rank ended here: even data
        statuses = self._votes.gather(ticket.status) if self.voting else [ticket.status]
        short = [r for r, s in enumerate(statuses) if s == Status.EXHAUSTED]
        if self._options.on_uneven == "error":
            long = [r for r, s in enumerate(statuses) if s != Status.EXHAUSTED]
            raise UnevenDataError(
                f"uneven data: rank(s) {short} have {ticket.position} batches, rank(s) {long} at least "
                f"{ticket.position + 1}. Give every rank the same number of batches (drop_last, or pad the "
                'shards), or pass ranks=RankOptions(on_uneven="stop") to train the common count.'
            )
        untrained = [c.batch for c in dropped if c.ticket.status != Status.EXHAUSTED]
        if untrained:
            self.untrained_batches.extend(untrained)
            warnings.warn(
                f"rank {self._failure.rank}: {len(untrained)} batch(es) fetched but not trained: rank(s) "
                f"{short} ran out of data after {ticket.position} batches, so every rank stopped there. "
                "They are in the pipeline's `untrained_batches`.",
                stacklevel=3,
            )
        return False

    def wait_votes(self) -> None:
        """Wait for every vote started so far, so that none is in flight between two `progress()` calls,
        where the caller may destroy the process groups; raises `CollectiveFailed` where one failed."""
        pending, self.pending_votes = self.pending_votes, []
        for vote in pending:
            vote.wait()

    def drop_votes(self) -> None:
        """Forget the votes in flight without waiting (after a failure or an interrupt)."""
        self.pending_votes = []

    def close(self) -> None:
        """Forget the votes in flight and destroy every process group this pipeline made."""
        self.drop_votes()
        self._votes.forget_group()
        self.groups.destroy_all()

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (blocking, where every rank reaches it by construction)."""
        return self._votes.gather(obj)

    def agree_on(self, what: str, text: str, advice: str | None = None) -> None:
        """Check, once, that every rank has the same `text` before a collective that depends on it; raises
        `RewriteMismatchError` on every rank where not, naming the ranks and `advice` (what to do)."""
        if not self.voting:
            return
        texts = self._votes.gather(text)
        if len(set(texts)) > 1:
            shown = "\n".join(f"  rank {r}:\n    " + t.replace("\n", "\n    ") for r, t in enumerate(texts))
            advice = advice or (
                "Make the model's calls of its sharded modules the same on every rank "
                "(no branch on batch data before them), or give explicit arg_paths."
            )
            raise RewriteMismatchError(
                f"the ranks found different {what}, so their collectives would not match:\n{shown}\n{advice}"
            )

    def fail(self, error: BaseException, reset: Callable[[], None]) -> None:
        """This rank raised inside `progress()`: `reset()` the batches in flight and, under
        `abort_on_error`, leave no peer waiting (`FailureSignal.fail`, which may raise `PeerFailedError`)."""
        if self._options.abort_on_error:
            self._failure.fail(error, reset)
        else:
            reset()


class StatefulIterator(Protocol):
    """An iterator whose `state_dict()` says where its next item comes from: a snapshot, which later
    `next()` calls must not change (the pipeline keeps one per batch in flight)."""

    def __next__(self) -> Any: ...

    def state_dict(self) -> Any: ...


def resume_state(iterator: Iterator[Any], inflight: Iterable[Any]) -> Any:
    """The state to restore `iterator` to so that it yields the oldest untrained batch next
    (`inflight`: its batches' contexts, oldest first); a TypeError where it has no `state_dict()`."""
    if getattr(iterator, "state_dict", None) is None:
        raise TypeError(
            f"{type(iterator).__name__} has no state_dict(), so the pipeline cannot say where its "
            "oldest untrained batch came from: use a stateful dataloader (torchdata's "
            "StatefulDataLoader) or call pipe.drain(iterator) on every rank before saving"
        )
    for ctx in inflight:
        return ctx.loader_state  # the oldest: fetched after every batch that has been trained
    return iterator.state_dict()


def _next_or_none(iterator: Any) -> Any:
    return next(iterator, None)
