"""Ranks agreeing on each batch before it enters a collective: uneven data, bad keys, failed peers.

Every rank has a status for every batch position it fetches: `HAVE`, `EXHAUSTED` (its dataloader ran
dry) or `BAD_KEYS` (the batch's KeyedJaggedTensor keys differ from the first batch's). The ranks
learn each other's statuses before the batch enters its first collective, in one of two ways:

- Votes (`Agreement`): one asynchronous all_reduce of a `[world_size]` int64 tensor (each rank fills
  its own slot) on a gloo group of the pipeline's own, issued at fetch and waited before the batch's
  first collective. Used where nothing else orders the ranks: the first two batches of a lane, and
  the batches read ahead under `execute_all_batches=False`. On two shared cores its threads cost about a
  millisecond a step, too much for every batch.
- Flags (`StoreFlags`), for every other batch: a rank whose status is not `HAVE` writes it into the
  default process group's store when it fetches the batch; every rank reads one counter from the
  store (one round trip, 15 us idle, 100-300 us on two busy cores) and the details only when the
  counter moved. A flag is always written in time: a rank fetches batch j before it takes part in
  the collectives of the step before j, which every other rank must complete before it reads the
  flags for j. So the read is started as soon as this rank has completed such a collective, on a
  background thread (`pipeline.background`), and joined just before batch j's first collective:
  under SparseDist after the splits all-to-all of the batch before j (when it runs on a group of
  every rank), overlapping backward and optimizer; under Base after the forward of the step before
  j when a sharded module in it waited for an all-to-all over every rank (`WorldCollectiveSeen`),
  overlapping backward and optimizer, else after backward, overlapping the optimizer step; else at
  the end of the step before j.

A rank whose dataloader is exhausted keeps adding placeholders (no batch) until the end is agreed, so
every rank holds as many batches in flight and issues the same collectives in order.

A rank that fails instead is `pipeline.failure`'s.
"""

from __future__ import annotations

import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from pipeline.background import in_background
from pipeline.failure import rank_and_world
from rewrite import find_kjts, outermost_sharded

__all__ = [
    "BAD_KEYS",
    "EXHAUSTED",
    "HAVE",
    "AgreedError",
    "Agreement",
    "BatchKeysError",
    "KeyCheck",
    "StoreFlags",
    "UnevenDataError",
    "Vote",
    "WorldCollectiveSeen",
]

EXHAUSTED, HAVE, BAD_KEYS = 0, 1, 2


class AgreedError(RuntimeError):
    """Raised on every rank at the same step: the process group is still usable."""


class UnevenDataError(AgreedError):
    """`on_uneven="error"`: the ranks' dataloaders hold different numbers of batches."""


class BatchKeysError(AgreedError, ValueError):
    """A batch's KeyedJaggedTensor keys differ from those the model was sharded for."""


@dataclass(eq=False)
class Vote:
    """One batch's vote: `wait()` returns every rank's status for it, by rank."""

    work: Any
    tensor: torch.Tensor
    statuses: list[int] | None = None

    def wait(self) -> list[int]:
        if self.statuses is None:
            if self.work is not None:
                self.work.wait()
            self.statuses = [int(v) for v in self.tensor.tolist()]
        return self.statuses


class Agreement:
    """Issues the votes on a gloo group of its own (created on first use, at the same call on every
    rank), or locally when there is no process group of more than one rank.

    Args:
        timeout: how long a vote may wait for a peer before failing (a peer that hangs).
    """

    def __init__(self, *, timeout: timedelta) -> None:
        self._timeout = timeout
        self._group: Any = None

    @property
    def distributed(self) -> bool:
        return rank_and_world()[1] > 1

    def vote(self, status: int) -> Vote:
        """Start this rank's vote for the next batch; every rank calls it once per batch, in order."""
        rank, world = rank_and_world()
        if world == 1:
            return Vote(None, torch.tensor([status]))
        if self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=self._timeout)
        tensor = torch.zeros(world, dtype=torch.int64)
        tensor[rank] = status
        return Vote(dist.all_reduce(tensor, group=self._group, async_op=True), tensor)

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (a rare, blocking exchange: only on the error paths, which every rank
        enters at the same vote)."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj, group=self._group)
        return out


class StoreFlags:
    """Statuses other than `HAVE`, published in the default process group's store under `prefix`
    (unique per pipeline and lane, the same on every rank).

    Reading the flags for a batch costs one round trip to the store's host (rank 0), 80-180 us on
    two busy cores. `read_ahead` starts that round trip on a background thread as soon as it is
    valid, so that it overlaps the step and `statuses` finds the answer there.
    """

    def __init__(self, store: Any, prefix: str) -> None:
        self.store, self._prefix = store, prefix
        self._events = f"{prefix}/events"
        self._seen = 0
        self._flags: dict[int, tuple[int, int]] = {}
        self._ahead: tuple[int, Future] | None = None

    def raise_flag(self, status: int, position: int) -> None:
        """Publish this rank's `status` for batch `position` (EXHAUSTED: from there on)."""
        rank = dist.get_rank()
        self.store.set(f"{self._prefix}/r{rank}", f"{status} {position}")
        self.store.add(self._events, 1)  # after the set: a reader that sees it sees both

    def read_ahead(self, token: int) -> None:
        """Start reading the flags' counter in the background for the batch `token` names (its
        context's index).

        Call only once this rank has completed a collective that every rank issues after fetching
        that batch: a flag raised for it is then in the store, so the read cannot miss it.
        """
        self._ahead = (token, in_background(lambda: self.store.add(self._events, 0)))

    def statuses(self, position: int, world: int, token: int | None = None) -> list[int]:
        """Every rank's status for batch `position`, from the flags raised so far; the counter
        read ahead for `token` if there is one, else read now."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == token:
            events = ahead[1].result()
        else:
            events = self.store.add(self._events, 0)
        if events != self._seen:
            self._seen = events
            for rank in range(world):
                key = f"{self._prefix}/r{rank}"
                if self.store.check([key]):
                    status, at = map(int, self.store.get(key).split())
                    self._flags[rank] = (status, at)
        out = [HAVE] * world
        for rank, (status, at) in self._flags.items():
            if (status == EXHAUSTED and at <= position) or at == position:
                out[rank] = status
        return out


class WorldCollectiveSeen:
    """Whether the model's last forward waited for an all-to-all over every rank.

    A forward hook on each sharded module whose process group spans the world: its forward waits for
    its input all-to-all before it computes, so once the hook fired, every rank has issued that
    all-to-all. `TrainPipelineBase` reads the next batch's flags from then on (overlapping backward),
    instead of after backward, because every rank fetched that batch before this forward. `remove()`
    takes the hooks off the model again.
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


class KeyCheck:
    """Compares each batch's KeyedJaggedTensor keys, per path in the batch, with the first batch's.

    The first batch is the reference: torchrec's input_dist builds its feature order from the keys of
    the first batch it sees and does not look at them again, so a later batch with a feature renamed,
    missing or added would be embedded under the wrong tables without a word.

    Walking the whole batch for KeyedJaggedTensors costs ~60 us on a busy core, most of the check;
    so later batches are first looked up at the first batch's paths (a few us), and walked only if
    one differs, for the error's details. A KeyedJaggedTensor at a path the first batch did not
    have is not looked for: the model reads none there.
    """

    def __init__(self) -> None:
        self.expected: list[tuple[str, list[str]]] | None = None
        self._paths: list[tuple[Any, list[str]]] = []

    @staticmethod
    def keys_of(batch: Any) -> list[tuple[str, list[str]]]:
        return [(str(path), list(kjt.keys())) for path, kjt in find_kjts(batch)]

    def check(self, batch: Any) -> list[tuple[str, list[str]]] | None:
        """None if `batch` has the expected keys (or is the first); else the keys it has."""
        if self.expected is None:
            found = find_kjts(batch)
            self._paths = [(path, list(kjt.keys())) for path, kjt in found]
            self.expected = [(str(path), keys) for path, keys in self._paths]
            return None
        if self._paths and all(self._has_keys(batch, path, keys) for path, keys in self._paths):
            return None
        found = self.keys_of(batch)
        return None if found == self.expected else found

    @staticmethod
    def _has_keys(batch: Any, path: Any, keys: list[str]) -> bool:
        try:
            kjt = path.resolve(batch)
        except (AttributeError, KeyError, IndexError, TypeError):
            return False
        return isinstance(kjt, KeyedJaggedTensor) and kjt.keys() == keys


def keys_message(details: list[Any], expected: list[tuple[str, list[str]]] | None) -> str:
    """The key error's text, from every rank's `(rank, position, found keys or None)`."""
    bad = [d for d in details if d is not None and d[2] is not None]
    parts = [
        f"batch {position} of rank {rank}'s dataloader has keys {_show(found)}"
        for rank, position, found in bad
    ]
    return (
        f"{'; '.join(parts)}, but the model was sharded for {_show(expected or [])} (the keys of the "
        "first batch). Every rank stopped before that batch. Fix the dataset (a feature renamed, "
        "missing or added), or pass check_keys=False if the keys legitimately vary."
    )


def _show(keys: list[tuple[str, list[str]]]) -> str:
    return ", ".join(f"{keys} at {path or 'the batch'}" for path, keys in keys) or "no KeyedJaggedTensor"


def uneven_message(statuses: list[int], position: int) -> str:
    short = [r for r, s in enumerate(statuses) if s == EXHAUSTED]
    long = [r for r, s in enumerate(statuses) if s != EXHAUSTED]
    return (
        f"uneven data: rank(s) {short} have {position} batches, rank(s) {long} at least "
        f"{position + 1}. Give every rank the same number of batches (drop_last, or pad the shards), "
        'or pass on_uneven="stop" to train the common count.'
    )


def warn_untrained(rank: int, count: int, statuses: list[int], position: int) -> None:
    short = [r for r, s in enumerate(statuses) if s == EXHAUSTED]
    warnings.warn(
        f"rank {rank}: {count} batch(es) fetched but not trained: rank(s) {short} ran out of data "
        f"after {position} batches, so every rank stopped there. They are in the pipeline's "
        "`untrained_batches`.",
        stacklevel=4,
    )
