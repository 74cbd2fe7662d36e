"""Statuses riding on the fused splits all-to-all (docs/reference.md, "The status row"): whether a batch
is trained, decided without a collective of its own (`Admission`)."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torchrec.distributed.dist_data import KJTAllToAll, SplitsAllToAllAwaitable
from torchrec.distributed.embedding_sharding import FusedKJTListSplitsAwaitable, KJTSplitsAllToAllMeta
from torchrec.distributed.types import NoWait

from pipeline.ranks.protocol import RidingMismatchError, Status

if TYPE_CHECKING:
    from pipeline.ranks.protocol import Lane, Ranks

BatchContext = Any
"""`pipeline.stages.context.BatchContext`, which the ranks read without importing the stages."""

__all__ = [
    "NOTHING_PIPELINED",
    "NO_FULL_GROUP",
    "NO_RIDE",
    "RESTORED",
    "TAG",
    "Admission",
    "StatusOnly",
    "StatusSplits",
    "Word",
    "figure_of",
    "observed",
    "pack",
    "riding_fits",
    "splits_shape",
    "tagged",
    "unpack",
    "validating",
    "wait_refused_splits",
]


# -- the status row ----------------------------------------------------------------------------------


TAG = 0b101101
"""Marks a status word. A split (a count of ids or a batch size) read by mistake in its place
matches it and the row count by chance once in 65,536."""
_ROWS = 1 << 10
_FIGURE_BITS = 12
_OBSERVED_MAX = (1 << _FIGURE_BITS) - 1
RESTORED = (_OBSERVED_MAX - 1, _OBSERVED_MAX)
"""The figure of a watch holding a decision loaded from a checkpoint, per mode: above any observation."""


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
    return 0 if value is None else min(RESTORED[0] - 1, 1 + max(0, round(value * 1000)))


def tagged(which: int, figure: int) -> int:
    """The observation field carrying watch `which`'s (0 or 1) `figure` (`observed()`)."""
    return which << _FIGURE_BITS | figure if figure else 0


def figure_of(observation: int) -> tuple[int, int]:
    """(which watch, its figure) of an observation field (figure 0: none)."""
    return observation >> _FIGURE_BITS, observation & _OBSERVED_MAX


_OBSERVATION = 18
_SENT_ALIKE = (1 << _OBSERVATION) - 1
"""The bits of the status, the tag and the row count: alike on every rank that has the batch."""


def pack(status: Status | int, rows: int, observation: int = 0) -> int:
    """The word of `status` sent after `rows` splits rows (`observation`: `tagged()`), under 2^31 for
    torchrec's optional int32 check of the splits: bits 0-1 the status, 2-7 `TAG`, 8-17 `rows` mod
    1,024, 18-29 the figure (`observed`), 30 which watch."""
    return int(status) | TAG << 2 | (rows % _ROWS) << 8 | observation << _OBSERVATION


def unpack(word: int) -> Word:
    """The fields of a received word (check `tag` and `rows` before trusting the rest)."""
    rows, observation = (word >> 8) % _ROWS, word >> _OBSERVATION
    return Word(status=word & 3, tag=(word >> 2) & 0x3F, rows=rows, observation=observation)


class _StatusRow:
    """A splits all-to-all with a status row after its `rows` splits rows."""

    rows: int
    _splits_awaitable: Any
    received_rows: torch.Tensor | None = None
    """Once `words()` waited: every rank's splits rows as one host tensor, rank by row (None where
    torchrec's awaitable keeps no output tensor: the words only)."""

    def words(self) -> list[int]:
        """Per rank, what it sent at this rank's status row (the splits are waited here, once)."""
        awaitable = self._splits_awaitable
        received = awaitable.wait()
        if not isinstance(awaitable, NoWait):
            self._splits_awaitable = NoWait(received)
            output = getattr(awaitable, "_output_tensor", None)
            self.received_rows = output.view(awaitable.num_workers, -1) if output is not None else None
        return received[self.rows] if self.rows < len(received) else []  # too few: reported


class StatusSplits(_StatusRow, FusedKJTListSplitsAwaitable):
    """torchrec's fused splits all-to-all with one row more, this rank's `word(rows)`, which every rank
    reads (`words()`) before `wait()` issues the values all-to-alls (which do not see it).

    Raises:
        RuntimeError: torchrec's fused awaitable is not of the shape edited (`riding_fits` checks first).
    """

    def __init__(self, requests: list[Any], contexts: list[Any], pg: Any, word: Callable[[int], int]) -> None:
        rows, last, at, position = 0, None, 0, 0
        for request in requests:  # the last module's splits, at `at` in torchrec's flat list
            for awaitable in request.awaitables:
                if isinstance(awaitable, KJTSplitsAllToAllMeta):
                    rows, last, at = rows + len(awaitable.splits_tensors), awaitable, position
                position += 1
        self.rows = rows
        """The splits rows this rank sends before its word (its word's row index)."""
        status_row = torch.full((pg.size(),), word(rows), dtype=torch.int64, device=last.device)
        last.splits_tensors.append(status_row)
        try:
            super().__init__(requests=requests, contexts=contexts, pg=pg)
        finally:
            last.splits_tensors.pop()
        if self._awaitables[at] is not last or sum(self._lengths) != rows + 1:
            raise RuntimeError(f"torchrec's fused splits awaitable does not count {rows} rows and a word")
        self._lengths[at] -= 1
        self.carries = True


class StatusOnly(_StatusRow):
    """What a rank without the batch sends where the others send their fused splits: `rows` rows of
    zero splits and, where the others send `StatusSplits`, its word."""

    def __init__(self, pg: Any, rows: int, word: int | None, device: torch.device) -> None:
        world = pg.size()
        tensors = [torch.zeros(world, dtype=torch.int64, device=device) for _ in range(rows)]
        if word is not None:
            tensors.append(torch.full((world,), word, dtype=torch.int64, device=device))
        self.rows = rows
        self._splits_awaitable = SplitsAllToAllAwaitable(tensors, pg)
        self.carries = word is not None

    def wait(self) -> list[Any]:
        raise RuntimeError("a rank that sent only its status has no batch to distribute")


def splits_shape(fused: list[tuple[list[str], Any]]) -> list[tuple[Any, int, torch.device, bool]] | None:
    """Per group, what one batch's fused splits send (group, rows, device, whether the status rides),
    for a rank without a batch to send alike; None if no group spans every rank."""
    shape, rides = [], False
    for _, awaitable in fused:
        for meta in getattr(awaitable, "_awaitables", ()):
            if isinstance(meta, KJTSplitsAllToAllMeta):  # the group's first: its group and device
                if meta.pg is not None:
                    carries = isinstance(awaitable, StatusSplits)
                    shape.append((meta.pg, sum(awaitable._lengths), meta.device, carries))
                    rides = rides or carries
                break
    return shape if rides else None


def wait_refused_splits(fused: list[tuple[list[str], Any]]) -> None:
    """Wait for every splits all-to-all of a refused batch, starting no values all-to-all."""
    for _, awaitable in fused:
        if getattr(awaitable, "_splits_awaitable", None) is not None:
            awaitable._splits_awaitable.wait()


_A2A_FIELDS = ("_pg", "_splits", "_splits_cumsum", "_stagger")
_INPUT_DISTS = (
    "TwSparseFeaturesDist",
    "RwSparseFeaturesDist",
    "CwSparseFeaturesDist",
    "DpSparseFeaturesDist",
)
"""torchrec's input dists whose forward issues nothing but its KJTAllToAll (or nothing at all)."""


def riding_fits(modules: list[nn.Module]) -> str | None:
    """None if statuses can ride on these modules' fused splits (torchrec has the fields riding edits, and
    each input dist sends only its all-to-alls), else why not: alike on ranks of one torchrec and model."""
    fields_set = (  # the fields riding reads or edits, by the torchrec class whose __init__ sets them
        (FusedKJTListSplitsAwaitable, ("_awaitables", "_lengths", "_splits_awaitable")),
        (SplitsAllToAllAwaitable, ("_output_tensor", "num_workers")),
    )
    for cls, fields in fields_set:
        missing = [f for f in fields if f not in cls.__init__.__code__.co_names]
        if missing:
            return f"torchrec's {cls.__name__} no longer sets {', '.join(missing)}"
    for module in modules:
        for child in module.modules():
            for input_dist in getattr(child, "_input_dists", None) or []:
                kind = type(input_dist)
                if not any(
                    c.__name__ in _INPUT_DISTS and c.__module__.startswith("torchrec.") for c in kind.__mro__
                ):
                    return f"input dist {kind.__qualname__} may issue collectives of its own"
                a2a = getattr(input_dist, "_dist", None)
                if a2a is None:
                    continue
                if not isinstance(a2a, KJTAllToAll):
                    return f"input dist {kind.__qualname__} sends with {type(a2a).__qualname__}"
                absent = [f for f in _A2A_FIELDS if not hasattr(a2a, f)]
                if absent:
                    return f"torchrec's KJTAllToAll has no {', '.join(absent)}"
    return None


def validating() -> bool:
    """torchrec can tag each splits all-to-all to check that the ranks' collectives match; a rank
    without a batch could not send the tag, so statuses do not ride then."""
    try:
        from torchrec.distributed.collective_utils import validate_collectives_enabled
    except ImportError:  # an older torchrec: no tags
        return False
    return validate_collectives_enabled()


# -- admission ---------------------------------------------------------------------------------------


# Why a watch cannot agree with the other ranks, or has nothing to decide (its `no_ride`):

NO_RIDE = (
    "the ranks' statuses do not ride on this pipeline's splits all-to-all (RankOptions(agreement=False), "
    "a class that admits batches itself, or torchrec's collective checks), so the ranks have no shared "
    "observations of their steps to decide on"
)

NO_FULL_GROUP = (
    "no splits all-to-all of this model spans every rank (2D sharding: each runs on a subgroup), so "
    "the ranks' statuses do not ride on it and the ranks have no shared observations of their steps"
)

NOTHING_PIPELINED = (
    "no sharded module is pipelined (the rewrite report says why for each): their input all-to-alls "
    "run inside forward, so no splits all-to-all of the pipeline carries the ranks' statuses and "
    "there is no schedule to choose"
)


class Admission:
    """Whether a batch of an `InputDist` is trained: by a vote before its first collective (`admit`),
    or from the statuses riding on its splits all-to-all (`read_statuses`). Where a rank lacks the batch,
    both end in `Ranks.admit_from_counts`: the same error on every rank, or the batch dropped everywhere.

    Args:
        ranks: the pipeline's ranks' protocol (None: no agreement, nothing rides, every batch runs).
        enabled: the pipeline admits every batch through `InputDist.fill` and `start_next`.
        watch: the default schedule's watch, whose figure rides in the words (`add_watch` adds one).
    """

    def __init__(self, ranks: Ranks | None, enabled: bool, *, watch: Any = None) -> None:
        self._ranks = ranks
        self.enabled = enabled and ranks is not None and ranks.voting and not validating()
        self._watches: list[Any] = []
        """The watches whose figures ride in the words, taking turns (at most two)."""
        self._words = 0
        """Words packed so far (whose turn it is)."""
        if watch is not None:
            self.add_watch(watch)
        self.checked = False
        """Whether statuses can ride on the fused splits was decided (`check`: once is enough)."""
        self._shape: list[tuple[Any, int, Any, bool]] | None = None
        """What the last fused splits all-to-all sent (`splits_shape`): while known, statuses ride."""
        self.refused = 0
        """Batches some rank lacked, found out from statuses that rode (not from a vote)."""
        self._plain_row: tuple[tuple[int, int], torch.Tensor] = ((0, 0), torch.zeros(0, dtype=torch.int64))
        """((word, ranks), that word once per rank): the row read when every rank has the batch."""

    def check(self, modules: list[Any]) -> str | None:
        """At each fused start, deciding once, whether statuses can ride (`riding_fits`); where not, every
        batch is voted on, the watches are pinned, and the reason is returned for the report."""
        if self.checked or not self.enabled:
            return None
        self.checked = True
        why = riding_fits(modules)
        if why is None:
            return None
        self.enabled = False
        for watch in self._watches:
            if watch.choice is None:  # still watching or trying
                watch.no_ride(NO_RIDE)
        return f"the ranks vote on every batch; statuses do not ride on the splits all-to-all: {why}"

    def status_splits(self, ctx: BatchContext) -> Callable[..., Any] | None:
        """What builds `ctx`'s fused splits with this rank's word in it (HAVE for a batch voted on, so that
        the shape is learnt); None when statuses do not ride."""
        if not self.enabled:
            return None
        figure = 0
        for watch in self._watches:  # a settled watch publishes nothing: no figure to pick
            if not watch.settled:
                figure = self._figure()
                break
        word = functools.partial(pack, ctx.ticket.status, observation=figure)  # called with its row count
        return functools.partial(StatusSplits, word=word)

    def add_watch(self, watch: Any) -> None:
        """Let `watch`'s figures ride (where nothing rides, it is told so: `no_ride`)."""
        if len(self._watches) == 2:
            raise ValueError("a word carries the figures of two watches at most")
        if self._watches:  # each holds still while the other verifies a switch
            watch.partner, self._watches[0].partner = self._watches[0], watch
        self._watches.append(watch)
        if not self.enabled:
            watch.no_ride(NO_RIDE)

    def _figure(self) -> int:
        """The observation field of the next word: the figure of the watch whose turn it is."""
        live = []
        for i, watch in enumerate(self._watches):
            if watch.publishing:
                live.append(i)
        if not live:
            return 0
        which = live[self._words % len(live)]
        self._words += 1
        figure = self._watches[which].observation()
        return which << _FIGURE_BITS | figure if figure else 0  # `tagged`, without a call

    def learn(self, fused: list[tuple[list[str], Any]]) -> None:
        """After a fused start: what a rank without a batch must send from now on; where no group spans
        every rank, nothing rides from now on and the watches are told so."""
        if not self.enabled:
            return
        self._shape = splits_shape(fused) if fused else None
        self._ranks.carrying = self._shape is not None
        if self._shape is None:
            self.enabled = False
            for watch in self._watches:
                watch.no_ride(NO_FULL_GROUP if fused else NOTHING_PIPELINED)

    def forget(self) -> None:
        """The modules were restored: batches fetched from now on are voted on."""
        if self._shape is not None:
            self._shape, self._ranks.carrying = None, False

    def admit(self, lane: Any, ctx: BatchContext) -> bool:
        """Before `ctx`'s first collective: True if its input_dist may start (every rank has it, or its
        status rides on its splits). False: some rank lacks it; it left the lane with those after it.

        Raises:
            AgreedError: on every rank, as `Ranks.admit` says.
        """
        return self._ranks is None or self.status_in_splits(ctx) or self._ranks.admit(lane, ctx)

    def without_batch(self, ctx: BatchContext) -> bool:
        """At `ctx`'s start: its status rides (marked on `ctx`) and this rank sends only its word."""
        if not self.status_in_splits(ctx):
            return False
        ctx.status_rides = True
        return ctx.ticket.status is not Status.HAVE

    def status_in_splits(self, ctx: BatchContext) -> bool:
        """`ctx`'s status rides on its splits: it starts before the ranks' statuses are known."""
        ticket = ctx.ticket
        return (
            self._shape is not None
            and ticket is not None
            and ticket.carried
            and ticket.vote is None
            and not ticket.admitted
        )

    def status_only(self, ctx: BatchContext, current: Callable[[Any], Any]) -> list[tuple[list[str], Any]]:
        """What a rank without `ctx`'s batch sends on every group (`current`: the one in use now)."""
        status, figure = ctx.ticket.status, self._figure()
        return [
            ([], StatusOnly(current(pg), rows, pack(status, rows, figure) if carries else None, device))
            for pg, rows, device, carries in self._shape
        ]

    def _hand_out(self, observations: torch.Tensor) -> None:
        """Every rank's figures for one batch, to each watch those naming it (0 where a rank's names the
        other: a missing figure decides nothing but a loaded decision's fate)."""
        if len(self._watches) == 1:
            self._watches[0].received(observations)
            return
        which, figures = observations >> _FIGURE_BITS, observations & _OBSERVED_MAX
        for i, watch in enumerate(self._watches):
            mine = torch.where(which == i, figures, 0)
            if bool(mine.any()):
                watch.received(mine)

    def read_statuses(self, ctx: BatchContext, lane: Lane | None) -> bool:
        """At the splits wait: where `ctx`'s status rode, read every rank's (`Ranks.admit_from_counts` may
        raise on every rank). False: some rank lacks the batch, which left `lane` with those after it."""
        if not (ctx.status_rides and ctx.splits_requests):
            return True
        ctx.status_rides = False
        for _, status_row in ctx.splits_requests:
            if getattr(status_row, "carries", False):
                break
        else:
            raise RuntimeError("a batch whose status rides has no status row among its splits all-to-alls")
        words = status_row.words()
        plain = pack(Status.HAVE, status_row.rows)
        live = False
        for watch in self._watches:  # a settled watch publishes nothing
            live = live or (not watch.settled and watch.publishing)
        if words and not live and words.count(plain) == len(words):
            ctx.ticket.admitted = True  # every watch decided: every rank has it, counted in C
            return True
        if words:  # the row of every rank's word as a tensor: the one the all-to-all wrote, if kept
            received = status_row.received_rows
            row = (
                torch.tensor(words, dtype=torch.int64)
                if received is None
                else received[:, status_row.rows].cpu()
            )
            if self._plain_row[0] != (plain, len(words)):  # `plain` once per rank, made once
                self._plain_row = ((plain, len(words)), torch.full_like(row, plain))
            if torch.equal(row & _SENT_ALIKE, self._plain_row[1]):
                ctx.ticket.admitted = True  # every rank has it; the figures of a live watch ride
                if len(self._watches) == 1:  # `_hand_out`'s one watch, without a call
                    self._watches[0].received(row >> _OBSERVATION)
                else:
                    self._hand_out(row >> _OBSERVATION)
                return True
        statuses, figures = _read(words, status_row.rows, ctx.index)  # some rank lacks it, or a mismatch
        self._hand_out(torch.tensor(figures, dtype=torch.int64))
        counts = Counter(statuses)
        if counts[Status.HAVE] < sum(counts.values()):  # refused: wait for every group's splits first
            wait_refused_splits(ctx.splits_requests)
        if lane is None:
            raise RuntimeError("a batch whose status rode on its splits was waited for without its lane")
        if self._ranks.admit_from_counts(lane, ctx, counts):
            return True
        ctx.splits_requests = []
        self.refused += 1
        return False


def _read(words: list[int], rows: int, index: int) -> tuple[list[Status], list[int]]:
    """Every rank's status and figure from the words read at this rank's status row `rows`.

    Raises:
        RidingMismatchError: on every rank, where a rank's row there is no word of the same row count.
    """
    fields = [unpack(w) for w in words]
    wrong = [
        f"rank {r}: " + (f"a status word after {f.rows} splits rows" if f.tag == TAG else "not a status word")
        for r, f in enumerate(fields)
        if f.tag != TAG or f.rows != rows % 1024
    ]
    if wrong or not fields:
        raise RidingMismatchError(
            f"batch {index}: the ranks' fused splits all-to-alls do not match. This rank sent its status "
            f"after {rows} splits rows; at that row it read: {'; '.join(wrong) or 'nothing'}. The ranks' "
            "sharded modules must send the same number of splits per batch (the same KeyedJaggedTensor "
            "keys, weights on every rank or on none, the same variable-stride setting); or pass "
            "ranks=RankOptions(agreement=False) where every rank is known to have the same batches."
        )
    return [Status(f.status) for f in fields], [f.observation for f in fields]
