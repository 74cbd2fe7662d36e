"""The pipelines' options: one kw_only dataclass per concern, each field documented, each value
checked when the object is made.

A pipeline is built from a `PipelineOptions` (which `pipeline.compat.signatures` makes from torchrec's
positional and keyword arguments and our keyword-only extras); a class reads the options of the
concerns it has and ignores the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

__all__ = [
    "CompileOptions",
    "InputDistOptions",
    "LookupOptions",
    "MemoryOptions",
    "PipelineOptions",
    "PrefetchOptions",
    "RankOptions",
    "RewriteOptions",
    "SemiSyncOptions",
    "StepOptions",
    "TorchCompileConfig",
]

SCHEDULE_NAMES = ("auto", "early", "late", "early-shared", "late-own")
"""Values of `input_dist_schedule=` (`pipeline.stages.schedule.SCHEDULES` plus "auto")."""


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
    raised at the same step, destroy this process's process groups so that the peers stop within
    seconds with `PeerFailedError`."""
    failure_grace: float = 2.0
    """Seconds a failed rank waits for the others to fail too before destroying its groups."""
    peer_timeout: timedelta = timedelta(minutes=5)
    """How long the per-batch vote waits for a peer that neither votes nor fails."""

    def __post_init__(self) -> None:
        _one_of("on_uneven", self.on_uneven, ("stop", "error"))
        if self.failure_grace < 0:
            raise ValueError(f"failure_grace must be >= 0 seconds; got {self.failure_grace}")
        if not isinstance(self.peer_timeout, timedelta) or self.peer_timeout.total_seconds() <= 0:
            raise ValueError(f"peer_timeout must be a positive timedelta; got {self.peer_timeout!r}")


@dataclass(kw_only=True, slots=True)
class RewriteOptions:
    """How the sharded modules' forwards are found and replaced (docs/rewrite.md)."""

    method: str = "auto"
    """"auto" (explicit paths, then fx trace, then direct lookup), "explicit", "trace" or
    "direct"."""
    arg_paths: dict[str, Any] | None = None
    """Explicit `{sharded_module_fqn: path}`, e.g. `{"sparse_arch.ebc": "sparse"}`; FQNs are
    relative to the unwrapped model (see `rewrite_report`). A path may also be a torchrec-style
    `pipeline.ArgInfo` of attribute and item steps."""
    strict: bool = False
    """Fail on the first batch if any sharded module cannot be pipelined."""
    pipeline_postproc: bool = False
    """Run parameter-free modules that transform the batch ahead with input_dist, instead of
    leaving their sharded consumers unpipelined."""

    def __post_init__(self) -> None:
        _one_of("rewrite_method", self.method, ("auto", "explicit", "trace", "direct"))


@dataclass(kw_only=True, slots=True)
class InputDistOptions:
    """When the next batch's input all-to-alls run, and on which process group."""

    schedule: str = "auto"
    """"auto", "early", "late" (torchrec's), "early-shared" or "late-own" (`pipeline.stages.schedule`).
    "early", "late-own" and "auto" create one more process group per input_dist group."""
    tuner: Any = None
    """Under "auto", the `pipeline.stages.tuner.Tuner` to use; None: `Tuner()`."""

    def __post_init__(self) -> None:
        _one_of("input_dist_schedule", self.schedule, SCHEDULE_NAMES)


@dataclass(kw_only=True, slots=True)
class PrefetchOptions:
    """The prefetch stage of `PrefetchTrainPipelineSparseDist`."""

    prefetch_ahead: bool | str = "auto"
    """True: the prefetch of batch i+1 is submitted right after forward of i (on CPU on a worker
    thread), overlapping backward and optimizer; False: just before forward of i+1; "auto": True
    on CUDA, and on CPU while `prefetch()` takes at least `AHEAD_MIN_MS` a batch."""

    def __post_init__(self) -> None:
        _one_of("prefetch_ahead", self.prefetch_ahead, (True, False, "auto"))


@dataclass(kw_only=True, slots=True)
class MemoryOptions:
    """torchrec's memory flags (docs/pipeline.md, "torchrec's flags")."""

    enable_inplace_copy_batch: bool = False
    """Allocate the device copy of a batch on the stream that uses it, and copy into it on the
    memcpy stream, so it needs no `record_stream` (GPU only: on CPU the batch is not copied)."""
    free_features_storage_early: bool = False
    """Free the storage of a batch's KeyedJaggedTensor once every pipelined module's input_dist
    has made its own permuted copy (torchrec's modules keep the original only while permuting)."""
    clear_data_dist_inputs: bool = False
    """Before forward of a batch, wait for its input all-to-alls and free the tensors they sent."""


@dataclass(kw_only=True, slots=True)
class StepOptions:
    """torchrec's ordering and 2D-sharding flags."""

    enqueue_batch_after_forward: bool = False
    """Fetch and copy batch i+2 after forward of i instead of before it (so that on a GPU the
    host-to-device copy does not compete with the embedding lookups for PCIe)."""
    dmp_collection_sync_interval_batches: int | None = 1
    """With a `DMPCollection` (2D sharding), sync its replicas after backward of every batch whose
    index is a multiple of this; None never. Any other model takes only 1 (the default) or None."""

    def __post_init__(self) -> None:
        interval = self.dmp_collection_sync_interval_batches
        if interval is not None and (not isinstance(interval, int) or interval < 1):
            raise ValueError(
                f"dmp_collection_sync_interval_batches must be None or a positive int; got {interval!r}"
            )


@dataclass(kw_only=True, slots=True)
class LookupOptions:
    """Where the embedding lookup stage of the Fused pipeline runs."""

    emb_lookup_stream: str = "data_dist"
    """"data_dist" or "new": the lookup runs on the data_dist stream; "current": the caller's."""
    embedding_lookup_after_data_dist: bool = False
    """Run the lookup of batch i after starting input_dist of i+1 instead of first."""

    def __post_init__(self) -> None:
        _one_of("emb_lookup_stream", self.emb_lookup_stream, ("data_dist", "new", "current"))


@dataclass(kw_only=True, slots=True)
class SemiSyncOptions:
    """The semi-synchronous schedule of `TrainPipelineSemiSync`."""

    start_batch: int = 900
    """Index of the first batch whose successor is looked up before its backward."""
    stash_gradients: bool = False
    """Step the dense optimizer with the previous batch's gradients (torchrec's "true" semi-sync)."""

    def __post_init__(self) -> None:
        if not isinstance(self.start_batch, int) or self.start_batch < 0:
            raise ValueError(f"start_batch must be an int >= 0; got {self.start_batch!r}")


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
    """`progress()` calls that run the model un-compiled before it is compiled (so that the first
    steps can be profiled eagerly)."""

    def __post_init__(self) -> None:
        _one_of("dynamic", self.dynamic, (None, True, False))
        if not (isinstance(self.backend, str) or callable(self.backend)):
            raise ValueError(f"backend must be a backend name or a callable; got {self.backend!r}")
        if not isinstance(self.compile_on_iter, int) or self.compile_on_iter < 0:
            raise ValueError(f"compile_on_iter must be an int >= 0; got {self.compile_on_iter!r}")


@dataclass(kw_only=True, slots=True)
class CompileOptions:
    """torch.compile of the model (`TrainPipelinePT2`) and compiled autograd
    (`TrainPipelineSparseDistCompAutograd`); docs/pipeline.md, "PT2"."""

    compile_configs: Any = None
    """A `TorchCompileConfig` (ours or torchrec's, read field by field); None: the defaults."""
    pre_compile_fn: Callable[[Any], None] | None = None
    """Called with the model just before it is compiled."""
    post_compile_fn: Callable[[Any], None] | None = None
    """Called with the model just after it is compiled."""
    input_transformer: Callable[[Any], Any] | None = None
    """Applied to each batch, on the device, right before forward. None: every KeyedJaggedTensor
    in the batch is rebuilt for tracing (`pipeline.pipelines.pt2.pt2_input_transformer`), wherever it is."""
    compiled_autograd_options: dict[str, Any] | None = None
    """torch.compile's arguments for the backward under compiled autograd. None: the model's
    `_compiled_autograd_options` attribute as in torchrec, else torchrec's defaults (on CPU with
    fullgraph=False: fbgemm's CPU kernels cannot be traced)."""

    def __post_init__(self) -> None:
        config = self.compile_configs
        if config is None:
            self.compile_configs = TorchCompileConfig()
        elif not isinstance(config, TorchCompileConfig):
            fields = ("fullgraph", "dynamic", "backend", "compile_on_iter")
            self.compile_configs = TorchCompileConfig(**{f: getattr(config, f) for f in fields})
        options = self.compiled_autograd_options
        if options is not None and not isinstance(options, dict):
            raise ValueError(
                f"compiled_autograd_options must be a dict of torch.compile arguments; got {options!r}"
            )


@dataclass(kw_only=True, slots=True)
class PipelineOptions:
    """Everything a pipeline is built from besides the model, optimizer and device."""

    execute_all_batches: bool = True
    """When the dataloader is exhausted, run the batches in flight (True) or drop them, as
    torchrec's pipeline of the same name does (docs/pipeline.md, "execute_all_batches=False")."""
    custom_model_fwd: Callable[[Any], Any] | None = None
    """Called with the batch instead of the model (same return convention)."""
    streams: Any = None
    """The `pipeline.stages.streams.Streams` to run on; None: real streams on CUDA, none on CPU."""
    ranks: RankOptions = field(default_factory=RankOptions)
    """How the ranks agree (every class)."""
    rewrite: RewriteOptions = field(default_factory=RewriteOptions)
    """How the sharded modules are rewritten (every class but Base)."""
    input_dist: InputDistOptions = field(default_factory=InputDistOptions)
    """The input_dist schedule (every class but Base)."""
    prefetch: PrefetchOptions = field(default_factory=PrefetchOptions)
    """The prefetch stage (Prefetch only)."""
    memory: MemoryOptions = field(default_factory=MemoryOptions)
    """torchrec's memory flags (the classes whose torchrec counterpart takes them)."""
    step: StepOptions = field(default_factory=StepOptions)
    """torchrec's ordering and 2D-sharding flags (SparseDist, Fused, SemiSync)."""
    lookup: LookupOptions = field(default_factory=LookupOptions)
    """The lookup stage (Fused only)."""
    semi_sync: SemiSyncOptions = field(default_factory=SemiSyncOptions)
    """The semi-synchronous schedule (SemiSync only)."""
    compile: CompileOptions = field(default_factory=CompileOptions)
    """torch.compile and compiled autograd (PT2 and CompAutograd only)."""
