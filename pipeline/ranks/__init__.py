"""Cross-rank agreement: every rank learns, before a batch enters a collective, whether every other
rank has it (uneven data, wrong keys, a malformed batch) and whether a peer failed (`protocol.py`:
`Ranks`, its owner; `riding.py`, `kjt_check.py`, `failure.py`)."""

from pipeline.ranks.failure import (
    CollectiveFailed,
    FailureSignal,
    PeerFailedError,
    StopIterationInStepError,
    from_a_collective,
    rank_and_world,
)
from pipeline.ranks.kjt_check import KeyCheck, KJTCheck
from pipeline.ranks.protocol import (
    AgreedError,
    BatchKeysError,
    Lane,
    LaneState,
    MalformedBatchError,
    Ranks,
    RewriteMismatchError,
    RidingMismatchError,
    Status,
    Ticket,
    UnevenDataError,
    Vote,
    Votes,
)

__all__ = [
    "AgreedError",
    "BatchKeysError",
    "CollectiveFailed",
    "FailureSignal",
    "KJTCheck",
    "KeyCheck",
    "Lane",
    "LaneState",
    "MalformedBatchError",
    "PeerFailedError",
    "Ranks",
    "RewriteMismatchError",
    "RidingMismatchError",
    "Status",
    "StopIterationInStepError",
    "Ticket",
    "UnevenDataError",
    "Vote",
    "Votes",
    "from_a_collective",
    "rank_and_world",
]
