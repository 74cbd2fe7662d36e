"""The ranks' protocol: how every rank learns, before a batch enters a collective, whether every
other rank has it (uneven data, wrong keys) and whether a peer failed.

`Ranks` (`protocol.py`) is its one owner; the pieces are one concept a module: `status.py` (the
statuses and the errors raised on every rank), `votes.py`, `flags.py`, `keys.py`, `kjt_check.py`,
`failure.py`, `background.py` (the thread that reads the store ahead), `seen.py` and `lane.py`.
"""

from pipeline.ranks.background import in_background
from pipeline.ranks.failure import FailureSignal, PeerFailedError, is_comm_error, rank_and_world
from pipeline.ranks.flags import StoreFlags
from pipeline.ranks.keys import KeyCheck
from pipeline.ranks.kjt_check import KJTCheck
from pipeline.ranks.lane import Lane, LaneState, Ticket
from pipeline.ranks.protocol import Ranks, WorldMark
from pipeline.ranks.seen import WorldCollectiveHooks, backward_spans_world, spans_world
from pipeline.ranks.status import (
    AgreedError,
    BatchKeysError,
    MalformedBatchError,
    RewriteMismatchError,
    Status,
    UnevenDataError,
)
from pipeline.ranks.votes import Vote, Votes

__all__ = [
    "AgreedError",
    "BatchKeysError",
    "FailureSignal",
    "KJTCheck",
    "KeyCheck",
    "Lane",
    "LaneState",
    "MalformedBatchError",
    "PeerFailedError",
    "Ranks",
    "RewriteMismatchError",
    "Status",
    "StoreFlags",
    "Ticket",
    "UnevenDataError",
    "Vote",
    "Votes",
    "WorldCollectiveHooks",
    "WorldMark",
    "backward_spans_world",
    "in_background",
    "is_comm_error",
    "rank_and_world",
    "spans_world",
]
