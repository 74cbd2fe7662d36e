"""Restarts under torchrun (`--max-restarts`): which attempt this process is, and a process-group
store that no earlier attempt has written to.

torchrun's c10d rendezvous shares one TCPStore between the launcher and every attempt of the job
(`TORCHELASTIC_USE_AGENT_STORE=True`), and torch (2.13, and the pinned 2.14.1) does not separate the
attempts' keys in it: a restarted rank can read a dead rank's address from the last attempt and fail
with "Gloo connectFullMesh failed ... Connection refused". Each attempt therefore puts its process
groups under a prefix of its own.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["attempt", "attempt_store"]


def attempt() -> int:
    """Which attempt of a torchrun job this process is (0 for the first, or without torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def attempt_store(timeout: timedelta = timedelta(minutes=10)) -> Any:
    """A store for `init_process_group` private to this attempt, or None (use env://) when not
    launched by torchrun with its shared store.

    Every rank of an attempt must agree on the attempt number, which torchrun gives all workers of
    a restarted group alike (a node that joins a running elastic job later would not: this example
    restarts the whole group at once).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout,
    )
    return dist.PrefixStore(f"dlrm/attempt{attempt()}/", store)
