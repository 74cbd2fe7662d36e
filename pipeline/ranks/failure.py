"""A rank that fails inside `progress()`, and its peers: they end within seconds, saying which rank
failed and why, instead of waiting for the process group's timeout.

A rank that raises writes what happened in the default process group's store and waits a grace
period for the others: if every rank raised at the same step, nothing else is done. Otherwise it
destroys its process groups: the peers' pending collectives then fail within about a second
("Connection closed by peer"), and they read the store to say which rank failed and why
(`PeerFailedError`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["FailureSignal", "PeerFailedError", "StopIterationInStepError", "is_comm_error", "rank_and_world"]


class PeerFailedError(RuntimeError):
    """Another rank raised inside `progress()`; this rank stopped too."""


class StopIterationInStepError(RuntimeError):
    """A `StopIteration` was raised inside a step (forward, backward, the optimizer, a stage), not
    at the dataloader's end; raised in its place, from it (`__cause__`).

    Let through, it would end this rank's loop as if its data had ended while its peers wait in the
    step's collectives (until the process group's timeout). As an error it takes the failure path:
    the peers stop within `failure_grace` with `PeerFailedError`. (Python turns a StopIteration
    inside a generator into a RuntimeError for the same reason, PEP 479.)
    """

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


class FailureSignal:
    """Tells the peers that this rank failed, and finds out whether they did too.

    Each failure is a "generation" of keys in the default process group's store: every rank that
    fails writes `rank<r>` (what it raised) and adds 1 to `count`. A rank that raised waits up to
    `grace` seconds for `count` to reach the world size: if every rank raised at the same step (a
    bad batch on all of them), the process groups are still consistent and nothing is destroyed.
    Holds a reference to the store (taken while the group is alive), so that it can still be read
    after the groups are destroyed.
    """

    def __init__(self, *, grace: float, scope: str = "") -> None:
        self.store: Any = None
        """The default process group's store (None in a single process)."""
        self._grace = grace
        self._scope = scope
        """Keeps one pipeline's keys apart from another's in the same store (a failure two
        pipelines ago must not count in this one's generation 0)."""
        self._generation = 0
        self.rank, world = rank_and_world()
        self.world = world
        self.distributed = world > 1
        if self.distributed:
            with contextlib.suppress(Exception):
                self.store = dist.distributed_c10d._get_default_store()

    def _key(self, name: str) -> str:
        return f"trainpipeline/{self._scope}failure{self._generation}/{name}"

    def announce(self, error: BaseException) -> None:
        """Record this rank's failure (what it raised)."""
        if self.store is not None:
            with contextlib.suppress(Exception):
                text = f"rank {self.rank} raised {type(error).__name__}: {error}"
                self.store.set(self._key(f"rank{self.rank}"), text[:2000])
                self.store.add(self._key("count"), 1)

    def all_failed(self) -> bool:
        """Wait up to `grace` seconds for every rank to announce a failure of this generation."""
        if self.store is None:
            return False
        deadline = time.monotonic() + self._grace
        try:
            while self.store.add(self._key("count"), 0) < self.world:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.02)
        except Exception:  # the store's host (rank 0) is gone
            return False
        return True

    def peer_failures(self) -> list[str]:
        """What the peers that failed in this generation wrote (empty if none, or if the store
        cannot be read: its host, rank 0, may be gone)."""
        found = []
        for rank in range(self.world):
            if rank == self.rank or self.store is None:
                continue
            with contextlib.suppress(Exception):
                key = self._key(f"rank{rank}")
                if self.store.check([key]):
                    found.append(self.store.get(key).decode(errors="replace"))
        return found

    def rendezvous(self, name: str, timeout: float) -> None:
        """Wait until every rank reached `name` (once per name, the same names in the same order
        on every rank), polling the store, so that a blocking rendezvous after it (a new process
        group's) is entered by every rank or by none.

        A peer that failed before reaching it never will, and `dist.new_group` would wait for it
        for the store's timeout (300 s): this raises as soon as a peer announced a failure.

        Raises:
            PeerFailedError: a peer announced a failure (its text in the message), the store's host
                is gone, or `timeout` seconds passed.
        """
        if self.store is None:
            return
        key = f"trainpipeline/rendezvous/{name}"
        deadline = time.monotonic() + timeout
        try:
            arrived = self.store.add(key, 1)
            while arrived < self.world:
                if self.store.add(self._key("count"), 0) > 0:
                    failed = "; ".join(self.peer_failures()) or "a peer announced a failure"
                    raise PeerFailedError(f"rank {self.rank} stopped at {name}: {failed}")
                if time.monotonic() > deadline:
                    raise PeerFailedError(f"rank {self.rank}: no peer reached {name} in {timeout:.0f} s")
                time.sleep(0.005)
                arrived = self.store.add(key, 0)
        except PeerFailedError:
            raise
        except Exception as e:  # the store's host (rank 0) is gone
            raise PeerFailedError(f"rank {self.rank} lost the store at {name}: {e}") from e

    def next_generation(self) -> None:
        self._generation += 1

    def fail(self, error: BaseException, reset: Callable[[], None]) -> None:
        """This rank raised `error` inside `progress()`: `reset()` its batches in flight and make
        sure no peer is left waiting in a collective for it (announce, wait `grace` for the others,
        destroy the process groups unless every rank failed at the same step).

        Raises:
            PeerFailedError: the error came from a peer's failure (a collective broken by it).
        """
        if not self.distributed:
            reset()
            return
        if is_comm_error(error):
            peers = self.peer_failures()
            try:
                reset()
            finally:
                self.abort()
            cause = "; ".join(peers) or "no rank recorded an error: a peer was probably killed or exited"
            raise PeerFailedError(
                f"rank {self.rank} stopped because a peer failed ({cause}). This rank's process "
                "groups were destroyed; restart the job."
            ) from error
        self.announce(error)
        every_rank_failed = self.all_failed()
        self.next_generation()
        try:
            reset()
        finally:
            if not every_rank_failed:  # a peer may be waiting in a collective for this rank
                self.abort()

    @staticmethod
    def abort() -> None:
        """Destroy every process group of this process: peers blocked in a collective with it fail
        instead of waiting for the group's timeout."""
        if dist.is_available() and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def is_comm_error(error: BaseException) -> bool:
    """A collective failed (a peer closed its connection or timed out), as opposed to this rank's
    own code raising."""
    if isinstance(error, PeerFailedError):
        return True
    dist_error = getattr(torch.distributed, "DistError", ())
    text = str(error)
    return isinstance(error, dist_error) or any(
        marker in text for marker in ("Connection closed by peer", "Connection reset by peer", "Timed out")
    )
