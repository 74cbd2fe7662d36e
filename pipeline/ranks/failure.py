"""A rank that fails inside `progress()`, and its peers: they end within seconds, saying which rank
failed and why, instead of waiting for the process group's timeout (the cases: docs/pipeline.md,
"When a rank fails"). Errors are told apart by where they were raised, never by their text."""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

__all__ = [
    "CollectiveFailed",
    "FailureSignal",
    "PeerFailedError",
    "StopIterationInStepError",
    "collective_code",
    "from_a_collective",
    "job_store",
    "rank_and_world",
]


class PeerFailedError(RuntimeError):
    """Another rank failed inside `progress()` (or a collective with it broke); this rank stopped too."""


class CollectiveFailed(RuntimeError):
    """A collective the pipeline waits on itself (a vote, a gather) failed: a peer left or timed out."""


class StopIterationInStepError(RuntimeError):
    """A `StopIteration` raised inside a step, not by the dataloader's end, raised in its place: let
    through, it would end this rank's loop alone while its peers wait in the step's collectives."""

    def __init__(self) -> None:
        super().__init__(
            "a StopIteration was raised inside the step (forward, backward, the optimizer or a stage), "
            "not by the dataloader's end: raised as an error so that this rank's loop does not end "
            "alone while its peers wait; see its cause for where it came from"
        )


def rank_and_world() -> tuple[int, int]:
    """(rank, world size); (0, 1) without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@functools.cache
def collective_code() -> frozenset[str]:
    """The source files of torch.distributed's, DDP's and torchrec's communication modules."""
    import torch.nn.parallel.distributed as ddp
    import torchrec.distributed.comm_ops as comm_ops
    import torchrec.distributed.dist_data as dist_data
    from torch.distributed import distributed_c10d

    return frozenset(m.__file__ for m in (distributed_c10d, ddp, comm_ops, dist_data))


def from_a_collective(error: BaseException) -> bool:
    """Whether `error` is a collective's failure, not this rank's own: `CollectiveFailed`,
    `PeerFailedError`, NCCL's `DistError`, or an error raised in `collective_code()` (gloo's there)."""
    if isinstance(error, (CollectiveFailed, PeerFailedError, getattr(dist, "DistError", ()))):
        return True
    frame = error.__traceback__
    if frame is None:
        return False
    while frame.tb_next is not None:
        frame = frame.tb_next
    return frame.tb_frame.f_code.co_filename in collective_code()


def job_store() -> Any:
    """The default process group's store; None without a group, or (with a warning) without a store."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError) as e:
        warnings.warn(
            f"the default process group has no store the pipeline can use ({e}): a rank that fails "
            "cannot tell its peers why, and a group the pipeline makes cannot wait out a peer that "
            "failed first; the peers still stop once the failed rank's process groups close",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


_handled = 0  # agreed failures handled: alike on every rank, it names the next failure's store keys


class FailureSignal:
    """Tells the peers that this rank failed, and learns whether they did too: each failing rank
    writes what it raised and counts itself in the job's store, held to be read after the groups are
    gone, then waits `grace` seconds for every rank (`scope`: keys apart from other signals', tests)."""

    def __init__(self, *, grace: float, scope: str = "") -> None:
        self._grace, self._scope = grace, scope
        self.rank, self.world = rank_and_world()
        self.distributed = self.world > 1
        self.store: Any = job_store() if self.distributed else None  # None: one process, or no store

    def _key(self, name: str) -> str:
        return f"trainpipeline/{self._scope}failure{_handled}/{name}"

    def announce(self, error: BaseException) -> None:
        """Record this rank's failure (what it raised)."""
        if self.store is not None:
            text = f"rank {self.rank} raised {type(error).__name__}: {error}"
            self.store.set(self._key(f"rank{self.rank}"), text[:2000])
            self.store.add(self._key("count"), 1)

    def all_failed(self) -> bool:
        """Wait up to `grace` seconds for every rank to announce a failure of this generation."""
        if self.store is None:
            return False
        key, deadline = self._key("count"), time.monotonic() + self._grace
        # `check` first: `get` would wait for a key no rank made yet
        while not self.store.check([key]) or int(self.store.get(key)) < self.world:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def peer_failures(self) -> list[str]:
        """What the peers that failed in this generation wrote (empty if none)."""
        found = []
        for rank in range(self.world):
            key = self._key(f"rank{rank}")
            if rank != self.rank and self.store is not None and self.store.check([key]):
                found.append(self.store.get(key).decode(errors="replace"))
        return found

    def rendezvous(self, name: str, timeout: float) -> None:
        """Wait until every rank reached `name` (each name once, in the same order on every rank), so
        that a blocking rendezvous after it (`dist.new_group`'s) is entered by every rank or by none; raises
        `PeerFailedError` where a peer announced a failure, the store's host is gone, or `timeout` passed."""
        if self.store is None:
            return
        key = f"trainpipeline/{self._scope}rendezvous/{name}"
        deadline = time.monotonic() + timeout
        try:
            arrived = self.store.add(key, 1)
            while arrived < self.world:
                if self.store.check([self._key("count")]):
                    failed = "; ".join(self.peer_failures()) or "a peer announced a failure"
                    raise PeerFailedError(f"rank {self.rank} stopped at {name}: {failed}")
                if time.monotonic() > deadline:
                    raise PeerFailedError(f"rank {self.rank}: no peer reached {name} in {timeout:.0f} s")
                time.sleep(0.005)
                arrived = self.store.add(key, 0)
            self._leave(key)
        except PeerFailedError:
            raise
        except RuntimeError as e:  # the store's host (rank 0) is gone
            raise PeerFailedError(f"rank {self.rank} lost the store at {name}: {e}") from e

    def _leave(self, key: str, *more: str) -> None:
        """This rank is done with `key` (and `more`): the last rank to say so deletes them."""
        if self.store.add(f"{key}/left", 1) == self.world:
            for name in (key, *more, f"{key}/left"):
                self.store.delete_key(name)

    def fail(self, error: Exception, reset: Callable[[], None]) -> None:
        """This rank raised `error` inside `progress()`: `reset()` its batches in flight, announce it,
        wait `grace` for the others, and destroy the process groups unless every rank failed at this step;
        raises `PeerFailedError` where `error` is a collective's failure (`from_a_collective`): a peer's."""
        if not self.distributed:
            reset()
            return
        if from_a_collective(error):
            peers = self._read(self.peer_failures, [], error)
            try:
                reset()
            finally:
                self.abort()
            cause = "; ".join(peers) or "no rank recorded an error: a peer was probably killed or exited"
            raise PeerFailedError(
                f"rank {self.rank} stopped because a peer failed ({cause}); the collective that broke: "
                f"{type(error).__name__}: {_first_line(error)}. This rank's process groups were "
                "destroyed; restart the job."
            ) from error
        self._read(lambda: self.announce(error), None, error)
        every_rank_failed = self._read(self.all_failed, False, error)
        peers = self._read(self.peer_failures, [], error)
        if every_rank_failed:
            self._read(self._agreed, None, error)
        try:
            reset()
        finally:
            if peers:
                _note(error, "the other ranks failed too: " + "; ".join(peers))
            if not every_rank_failed:  # a peer may be waiting in a collective for this rank
                self.abort()
                _note(
                    error,
                    f"rank {self.rank} destroyed its process groups (the job's default group and every "
                    f"group made since) so that its peers, which did not fail within failure_grace "
                    f"({self._grace} s), stop instead of waiting for the groups' timeout; pass "
                    "abort_on_error=False in RankOptions to keep them",
                )

    def _read(self, call: Callable[[], Any], otherwise: Any, error: BaseException) -> Any:
        """`call()`, which uses the store; `otherwise` (and a note on `error`) where its host is gone."""
        try:
            return call()
        except RuntimeError as lost:
            if self.store is not None:
                self.store = None
                _note(error, f"the job's store could not be reached ({lost}): the peers were not told why")
            return otherwise

    def _agreed(self) -> None:
        """Every rank failed here: the next failure gets keys of its own; the last rank out deletes these."""
        global _handled
        ranks = [self._key(f"rank{r}") for r in range(self.world)]
        self._leave(self._key("count"), *ranks)
        _handled += 1

    @staticmethod
    def abort() -> None:
        """Destroy every process group of this process, so that peers blocked in a collective fail."""
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def _first_line(error: BaseException) -> str:
    text = str(error)
    return text.splitlines()[0] if text else ""


def _note(error: BaseException, text: str) -> None:
    if hasattr(error, "add_note"):
        error.add_note(text)
