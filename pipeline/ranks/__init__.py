"""The ranks' protocol: how every rank learns, before a batch enters a collective, whether every
other rank has it (uneven data, wrong keys) and whether a peer failed.

`Ranks` (`protocol.py`, beside the dataloader's state captured before each fetch) is its one owner;
it fetches each batch and checks its KeyedJaggedTensors (`kjt_check.py`: keys and well-formedness).
`Admission` (`riding.py`) decides for the batches of an input_dist whether each is trained, by its
vote or by its status riding on its splits all-to-all (`rows.py`: the word and the row that carries
it). The other pieces are one concept a module: `status.py` (the statuses and the errors raised on
every rank), `votes.py`, `failure.py` and `lane.py`.
"""

from pipeline.ranks.failure import (
    FailureSignal,
    PeerFailedError,
    StopIterationInStepError,
    is_comm_error,
    rank_and_world,
)
from pipeline.ranks.kjt_check import KeyCheck, KJTCheck
from pipeline.ranks.lane import Lane, LaneState, Ticket
from pipeline.ranks.protocol import Ranks
from pipeline.ranks.status import (
    AgreedError,
    BatchKeysError,
    MalformedBatchError,
    RewriteMismatchError,
    RidingMismatchError,
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
    "RidingMismatchError",
    "Status",
    "StopIterationInStepError",
    "Ticket",
    "UnevenDataError",
    "Vote",
    "Votes",
    "is_comm_error",
    "rank_and_world",
]
