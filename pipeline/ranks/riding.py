"""`Admission`: whether each batch of an `InputDist` is trained, by its vote or by its status
riding on its fused splits all-to-all instead of a vote.

Once the sharded modules' splits all-to-alls are fused, a batch's first collective is that one
all-to-all, which every rank issues anyway: each rank adds its word (its status, its row count and
one watch's figure) as one more row (`pipeline.ranks.rows`), and the splits wait reads every rank's
word before any values move. A rank without the batch (its data ended, or the batch is rejected)
sends zero splits of the shape the others send, recorded from an earlier batch, with its word
(`StatusOnly`). Every receiver checks each word's tag and row count against its own: a mismatch
(ranks sending different numbers of splits rows) raises `RidingMismatchError` on every rank, naming
the ranks, never a misread status. Once every watch has decided, a batch every rank has costs one
comparison of the words, in C. The first batch of every dataloader iterator is still voted on
(`Ranks.fetch`), as is any batch fetched before the splits are fused; a pipeline that admits
batches itself never lets statuses ride.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pipeline.ranks.rows import (
    TAG,
    StatusOnly,
    StatusSplits,
    figure_of,
    pack,
    riding_fits,
    settle_splits,
    splits_shape,
    tagged,
    unpack,
    validating,
)
from pipeline.ranks.status import RidingMismatchError, Status

if TYPE_CHECKING:
    from pipeline.ranks.protocol import Ranks
    from pipeline.stages.context import BatchContext

__all__ = ["NO_FULL_GROUP", "NO_RIDE", "Admission"]

NO_RIDE = (
    "the ranks' statuses do not ride on this pipeline's splits all-to-all (agreement=False, a class "
    "that admits batches itself, or torchrec's collective checks), so the ranks have no shared "
    "observations of their steps to decide on"
)
"""Why a watch cannot agree with the other ranks (`StepWatch.no_ride`)."""

NO_FULL_GROUP = (
    "no splits all-to-all of this model spans every rank (2D sharding: each runs on a subgroup), so "
    "the ranks' statuses do not ride on it and the ranks have no shared observations of their steps"
)
"""Why a watch cannot agree with the other ranks where no fused splits group spans every rank."""


class Admission:
    """The one owner of whether a batch of an `InputDist` is trained, whichever way its status
    arrives: by a vote before its first collective (`admit`, through `Ranks.admit`), or riding on
    its splits all-to-all (`admit` lets it start, `conclude` decides at the splits wait). Where a
    rank lacks the batch, both end in `Ranks.conclude`, which raises the same error on every rank
    or drops the batch everywhere.

    Args:
        ranks: the pipeline's ranks' protocol (None: no agreement, nothing rides, every batch runs).
        enabled: the pipeline admits every batch through `InputDist.fill` and `start_next`.
        watch: the default schedule's watch, whose figure rides in the words (`add_watch` adds one).
    """

    def __init__(self, ranks: Ranks | None, enabled: bool, *, watch: Any = None) -> None:
        self._ranks = ranks
        self.enabled = enabled and ranks is not None and ranks.voting and not validating()
        self._watches: list[Any] = []
        """The watches (`pipeline.stages.step_watch`) whose figures ride in the words, taking turns
        where more than one publishes (at most two)."""
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

    def check(self, modules: list[Any]) -> str | None:
        """At every fused start, deciding once: whether statuses can ride on these modules' splits
        (`riding_fits`); where they cannot, every batch is voted on from then on, the watch keeps
        torchrec's order, and the reason is returned (for the rewrite report)."""
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

    def carrier(self, ctx: BatchContext) -> Callable[..., Any] | None:
        """What builds `ctx`'s fused splits all-to-all with this rank's word in it (its status, its
        row count, a watch's figure; HAVE for a batch already agreed on, so that the
        shape is learnt), or None when statuses do not ride."""
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
        live = [i for i, w in enumerate(self._watches) if w.publishing]
        if not live:
            return 0
        which = live[self._words % len(live)]
        self._words += 1
        return tagged(which, self._watches[which].observation())

    def learn(self, fused: list[tuple[list[str], Any]]) -> None:
        """After a fused start: what a rank without a batch must send from now on. Where no group
        spans every rank (the same on every rank: it is the model's), nothing rides from now on and
        the watches are told so."""
        if not self.enabled:
            return
        self._shape = splits_shape(fused)
        self._ranks.carrying = self._shape is not None
        if self._shape is None:
            self.enabled = False
            for watch in self._watches:
                watch.no_ride(NO_FULL_GROUP)

    def forget(self) -> None:
        """The modules were restored: batches fetched from now on are voted on."""
        if self._shape is not None:
            self._shape, self._ranks.carrying = None, False

    def admit(self, lane: Any, ctx: BatchContext) -> bool:
        """Before `ctx`'s first collective: True if its input_dist may start, because every rank
        has it (a vote) or because its status rides on its splits (`conclude` decides). False:
        some rank lacks it, and it left the lane with the batches after it.

        Raises:
            AgreedError: on every rank, as `Ranks.admit` says.
        """
        return self._ranks is None or self.provisional(ctx) or self._ranks.admit(lane, ctx)

    def without_batch(self, ctx: BatchContext) -> bool:
        """At `ctx`'s start: whether its status rides (then marked on `ctx`) and this rank has no
        batch to send, only its word (`status_only`)."""
        if not self.provisional(ctx):
            return False
        ctx.status_rides = True
        return ctx.ticket.status is not Status.HAVE

    def provisional(self, ctx: BatchContext) -> bool:
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
        """What a rank without `ctx`'s batch sends: zero splits on every group the others use
        (`current` maps a recorded group to the one in use now) and its status where it rides."""
        status, figure = ctx.ticket.status, self._figure()
        return [
            ([], StatusOnly(current(pg), rows, pack(status, rows, figure) if carries else None, device))
            for pg, rows, device, carries in self._shape
        ]

    def _hand_out(self, observations: list[int]) -> None:
        """Every rank's figures for one batch, each watch the ones naming it (0 for a rank whose word
        names the other: a figure missing, which decides nothing but a loaded decision's fate)."""
        fields = [figure_of(o) for o in observations]
        for i, watch in enumerate(self._watches):
            mine = [f if w == i else 0 for w, f in fields]
            if any(mine):
                watch.received(mine)

    def conclude(self, ctx: BatchContext) -> bool:
        """At the splits wait: where `ctx`'s status rode, read every rank's. Where every rank sent
        the plain HAVE word the batch is admitted; otherwise the ranks' protocol decides
        (`Ranks.conclude`: it may raise on every rank). False: some rank lacks the batch, which
        left the lane with the batches after it."""
        if not (ctx.status_rides and ctx.splits_requests):
            return True
        ctx.status_rides = False
        for _, carrier in ctx.splits_requests:
            if getattr(carrier, "carries", False):
                break
        else:
            raise RuntimeError("a batch whose status rides has no status row among its splits all-to-alls")
        words = carrier.words()
        if words and words.count(pack(Status.HAVE, carrier.rows)) == len(words):
            ctx.ticket.admitted = True  # the steady case, in C: every rank has it, no word to unpack
            return True
        statuses, figures = _read(words, carrier.rows, ctx.index)
        self._hand_out(figures)
        counts = Counter(statuses)
        if counts[Status.HAVE] < sum(counts.values()):  # refused: wait for every group's splits first
            settle_splits(ctx.splits_requests)
        if self._ranks.conclude(self._ranks.lane, ctx, counts):
            return True
        ctx.splits_requests = []
        self.refused += 1
        return False


def _read(words: list[int], rows: int, index: int) -> tuple[list[Status], list[int]]:
    """Every rank's status and figure from the words read at this rank's status row `rows`.

    Raises:
        RidingMismatchError: a rank's row there is not a status word of the same row count (on every
            rank: each reads a wrong row, or a word whose count differs from its own).
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
            "agreement=False where every rank is known to have the same batches."
        )
    return [Status(f.status) for f in fields], [f.observation for f in fields]
