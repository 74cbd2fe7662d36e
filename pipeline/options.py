"""The options of ours a user passes to a pipeline, keyword-only (`ranks=`, `rewrite=`,
`input_dist=`, `prefetch=`): one dataclass per component, each field's default declared and checked
here only."""

from __future__ import annotations

import dataclasses
import inspect
import sys
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

__all__ = ["InputDistOptions", "PrefetchOptions", "RankOptions", "RewriteOptions", "TorchCompileConfig"]

SCHEDULE_NAMES = ("adaptive", "early", "late", "early-shared", "late-own")
"""Values of `InputDistOptions.schedule` (`pipeline.stages.schedule.SCHEDULES` and "adaptive"); "auto"
is taken too, as a deprecated name of "adaptive"."""

_PACKAGE = str(Path(__file__).resolve().parent)


def _user_frame() -> int:
    """The `stacklevel` of the first caller outside this package and the dataclass machinery, so
    that a warning names the user's line."""
    level, frame = 2, sys._getframe(2)
    while frame is not None and (
        frame.f_code.co_filename.startswith(_PACKAGE)
        or frame.f_code.co_filename == dataclasses.__file__
        or (frame.f_code.co_filename == "<string>" and frame.f_code.co_name == "__init__")
    ):
        level, frame = level + 1, frame.f_back
    return level


def _one_of(name: str, value: Any, allowed: tuple[Any, ...]) -> None:
    if value not in allowed:
        shown = ", ".join(str(a) for a in allowed)
        raise ValueError(f"{name} must be one of {shown}; got {value!r}")


@dataclass(kw_only=True, slots=True)
class RankOptions:
    """How the ranks agree on uneven data, wrong keys and failures (docs/pipeline.md, "Ranks that
    disagree")."""

    on_uneven: str = "stop"
    """When the ranks' dataloaders end at different batches: "stop" trains the shortest rank's
    count on every rank (the rest are in `untrained_batches`, with a warning); "error" raises
    `UnevenDataError` on every rank."""
    check_keys: bool = True
    """Compare each batch's KeyedJaggedTensor keys with the first batch's and raise
    `BatchKeysError` on every rank, before the batch enters a collective, if they differ."""
    check_kjts: bool = True
    """Check every batch's KeyedJaggedTensors (lengths summing to the values, no negative length,
    every id within its table's rows) and raise `MalformedBatchError` on every rank, before the
    batch enters a collective, naming the batch, the key and the problem."""
    agreement: bool = True
    """Vote on every batch across ranks. False only when every rank is known to have the same
    batches: uneven data then leaves a collective unmatched, as in torchrec."""
    abort_on_error: bool = True
    """When this rank raises inside `progress()`, record why in the store and, unless every rank
    raised at the same step, destroy this process's groups so that the peers stop with
    `PeerFailedError`."""
    failure_grace: float = 2.0
    """Seconds a failed rank waits for the others to fail too before destroying its groups."""
    peer_timeout: timedelta = timedelta(minutes=5)
    """How long a vote waits for a peer that neither votes nor fails (a riding status waits as long
    as its process group's timeout)."""

    def __post_init__(self) -> None:
        _one_of("RankOptions.on_uneven", self.on_uneven, ("stop", "error"))
        if self.failure_grace < 0:
            raise ValueError(f"failure_grace must be >= 0 seconds; got {self.failure_grace}")
        if not isinstance(self.peer_timeout, timedelta) or self.peer_timeout.total_seconds() <= 0:
            raise ValueError(f"peer_timeout must be a positive timedelta; got {self.peer_timeout!r}")


@dataclass(kw_only=True, slots=True)
class RewriteOptions:
    """How the sharded modules' forwards are found and replaced (docs/rewrite.md)."""

    method: str = "auto"
    """"auto" (explicit paths, then fx trace, then direct lookup where the trace fails, then a
    recording of the first batch's forward), or only "explicit", "trace", "direct" or "record"."""
    arg_paths: dict[str, Any] | None = None
    """Explicit inputs per sharded module FQN (as `rewrite_report` names them): a path in the batch
    (`{"sparse_arch.ebc": "sparse"}`), a torchrec `pipeline.ArgInfo`, or a function from a batch to a
    list with one entry per call of the module, each a KeyedJaggedTensor or an `(args, kwargs)` pair
    (`{"ebc": lambda b: [b.history, b.candidates]}`), checked against the first real forward."""

    def __post_init__(self) -> None:
        _one_of("RewriteOptions.method", self.method, ("auto", "explicit", "trace", "direct", "record"))


@dataclass(kw_only=True, slots=True)
class InputDistOptions:
    """When the next batch's input all-to-alls run, on which process group, and in what width."""

    schedule: str = "adaptive"
    """"adaptive" (the default): torchrec's order, moving every rank to "early" where the host blocks on
    the input all-to-alls and keeping it only if the steps after are faster (`pipeline.stages.watch`).
    "late" pins torchrec's order; "early", "early-shared", "late-own" pin that schedule
    (`pipeline.stages.schedule`). "early", "late-own", and "adaptive" where it moves, create one more
    process group per input_dist group. "auto": a deprecated name of "adaptive" (warns once)."""
    watch: Any = None  # a ScheduleWatch (the options import nothing of the stages, which import them)
    """Under "adaptive", the `pipeline.ScheduleWatch` to use (its window, threshold, margin);
    None: `ScheduleWatch()` (its constants and their measurements: docs/reference.md, "The default
    schedule")."""
    narrow_ids: bool | None = None
    """Send a sharded module's ids and lengths through the input all-to-all as int32 where every
    table of the module has fewer than 2^31 rows; the lookup widens them, so the numbers do not change
    (`pipeline.stages.narrow`). None: only where the ranks send at least `NARROW_FROM` ids a batch;
    True: wherever the tables allow; False: never."""

    def __post_init__(self) -> None:
        if self.schedule == "auto":
            warnings.warn(
                'InputDistOptions(schedule="auto"): "auto" is a deprecated name of the default, "adaptive": '
                'the schedule watch runs (pipe.tuner is a ScheduleWatch); pass "adaptive" or leave it out',
                DeprecationWarning,
                stacklevel=_user_frame(),
            )
            self.schedule = "adaptive"
        _one_of("InputDistOptions.schedule", self.schedule, SCHEDULE_NAMES)
        _one_of("InputDistOptions.narrow_ids", self.narrow_ids, (None, True, False))


@dataclass(kw_only=True, slots=True)
class PrefetchOptions:
    """The prefetch stage of `PrefetchTrainPipelineSparseDist`."""

    prefetch_ahead: bool | str = "auto"
    """True: the prefetch of batch i+1 is submitted right after forward of i (on CPU on a worker
    thread); False: just before forward of i+1; "auto": True on CUDA, on CPU False until `watch` finds
    True faster."""
    watch: Any = None  # a PrefetchWatch, as above
    """Under "auto" on CPU, the `pipeline.PrefetchWatch` that decides; None: `PrefetchWatch()`."""

    def __post_init__(self) -> None:
        _one_of("PrefetchOptions.prefetch_ahead", self.prefetch_ahead, (True, False, "auto"))


# Positional like torchrec's (`TorchCompileConfig(True)` is fullgraph there too): not kw_only.
@dataclass(slots=True)
class TorchCompileConfig:
    """torch.compile settings of `TrainPipelinePT2` (torchrec 1.8's fields, order and defaults)."""

    fullgraph: bool = False
    """Refuse graph breaks. A DistributedModelParallel always has some (DDP's logger, and on CPU
    fbgemm's table-batched ops, which register no fake kernels there), so True fails on it."""
    dynamic: bool | None = None
    """torch.compile's `dynamic`: None lets dynamo mark sizes dynamic when they change."""
    backend: Any = "inductor"
    """torch.compile's backend: "inductor" (C++ kernels built with the machine's compiler on
    CPU), "aot_eager", or a callable."""
    compile_on_iter: int = 3
    """`progress()` calls run un-compiled before the model is compiled."""

    def __post_init__(self) -> None:
        _one_of("dynamic", self.dynamic, (None, True, False))
        if not (isinstance(self.backend, str) or callable(self.backend)):
            raise ValueError(f"backend must be a backend name or a callable; got {self.backend!r}")
        if not isinstance(self.compile_on_iter, int) or self.compile_on_iter < 0:
            raise ValueError(f"compile_on_iter must be an int >= 0; got {self.compile_on_iter!r}")


_MOVED = {
    "rewrite_method": "rewrite=RewriteOptions(method=",
    "arg_paths": "rewrite=RewriteOptions(arg_paths=",
    "input_dist_schedule": "input_dist=InputDistOptions(schedule=",
    "narrow_ids": "input_dist=InputDistOptions(narrow_ids=",
    "prefetch_ahead": "prefetch=PrefetchOptions(prefetch_ahead=",
    "prefetch_watch": "prefetch=PrefetchOptions(watch=",
    **{f.name: f"ranks=RankOptions({f.name}=" for f in dataclasses.fields(RankOptions)},
}
"""The keywords of earlier releases that are now fields of an options object, and where each went."""


def moved_keyword(owner: type, keywords: dict[str, Any]) -> TypeError | None:
    """The TypeError for pipeline class `owner` given a keyword of an earlier release that is now an
    options field, naming that field; None where there is none or `owner.__init__` declares it."""
    params = inspect.signature(owner.__init__).parameters
    moved = [name for name in keywords if name in _MOVED and name not in params]
    if not moved or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return TypeError(
        f"{owner.__name__}.__init__() got an unexpected keyword argument {moved[0]!r}: our options "
        f"come as objects; pass {_MOVED[moved[0]]}...) (pipeline.options)"
    )
