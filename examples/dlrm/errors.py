"""How a training run ends on bad input: one paragraph from the rank that found it, exit status 2,
and nothing from the others.

`train.py` checks flags and files before any collective (every rank alike, rank 0 prints). What
only shows up while training (a malformed value on one rank's lines, a cache the kernel finds too
small) goes through `train_or_exit`: the rank that raised `InputError` prints it, once, on a line of
its own, and leaves without tearing down its process groups; a pipeline's peers then fail with
`PeerFailedError` naming that rank's `InputError`, and leave quietly with the same status.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, NoReturn

from examples.dlrm.config import InputError, TrainConfig

__all__ = ["exit_now", "train_or_exit"]

_LET_THE_MESSAGE_OUT = 2.0  # seconds a silent rank waits before leaving: see train_or_exit


def train_or_exit(config: TrainConfig, *, rank: int, world_size: int, device: Any) -> Any:
    """`loop.train(...)`'s result; on bad input, ends this process with status 2 after printing one
    `train.py: error:` paragraph (or none, on a rank that stopped only because a peer hit it, or
    when every rank hit the same error and this is not rank 0)."""
    from examples.dlrm.loop import train

    try:
        return train(
            config,
            rank=rank,
            world_size=world_size,
            device=device,
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        )
    except InputError as e:
        if rank == 0 or not e.every_rank:
            where = f" (rank {rank} of {world_size})" if world_size > 1 and not e.every_rank else ""
            # Rank 0's progress bar shares this stderr and its line has no end yet: start a new one.
            lead = "\n" if rank != 0 and config.show_progress else ""
            print(f"{lead}train.py: error: {e}{where}", file=sys.stderr, flush=True)
        else:
            time.sleep(_LET_THE_MESSAGE_OUT)  # torchrun stops rank 0 as soon as this rank is gone
        exit_now(2)
    except Exception as e:
        if _stopped_by_peer_failure(e) and not _stopped_by_peer_input_error(e, config.pipeline):
            # Another rank died or failed: one line, not a traceback; torchrun restarts the group
            # (--max-restarts) or reports the rank that failed first.
            print(f"train.py: {e}", file=sys.stderr, flush=True)
            exit_now(1)
        if not _stopped_by_peer_input_error(e, config.pipeline):
            raise
        # The rank that read the bad input prints it and exits, and torchrun then stops this one:
        # leave it the time to (it prints right after breaking the collectives that stopped this
        # rank), so that its message is the one the user sees.
        time.sleep(_LET_THE_MESSAGE_OUT)
        exit_now(2)


def exit_now(status: int) -> NoReturn:
    """Flush and end the process at once with `status`.

    Process-group teardown is skipped: it can block on peers that are waiting in a collective for
    this rank, and torchrun stops them once this process is gone.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _stopped_by_peer_failure(error: Exception) -> bool:
    from pipeline import PeerFailedError

    return isinstance(error, PeerFailedError)


def _stopped_by_peer_input_error(error: Exception, pipeline_name: str) -> bool:
    if pipeline_name == "none":
        return False
    from pipeline import PeerFailedError

    return isinstance(error, PeerFailedError) and f"raised {InputError.__name__}" in str(error)
