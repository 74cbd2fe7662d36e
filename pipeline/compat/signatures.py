"""torchrec 1.8's constructor signatures, class by class, mapped onto our options.

Every pipeline class of ours accepts every parameter of torchrec 1.8's class of the same name, in
torchrec's positional order, and our own extras as keyword-only arguments after them. The
signatures live here, once: the classes declare none (`LanePipeline.__init__` binds the call
against the table), and `inspect.signature(cls)` shows the class's own.

A parameter that only torchrec has, and that means nothing here, is checked, not silently dropped:
`apply_jit=True` is refused, `context_type` is accepted and unused (contexts are internal).

`In`, `Out` (a pipeline's batch and output types) and `StageOut` (a `PipelineStage`'s) are
torchrec's own type variables, re-exported: our classes are generic over them through torchrec's
`TrainPipeline`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from torchrec.distributed.train_pipeline.pipeline_context import In, Out
from torchrec.distributed.train_pipeline.pipeline_stage import StageOut
from torchrec.distributed.train_pipeline.train_pipelines import TrainPipeline

from pipeline.config import (
    CompileOptions,
    InputDistOptions,
    LookupOptions,
    MemoryOptions,
    PipelineOptions,
    PrefetchOptions,
    RankOptions,
    RewriteOptions,
    SemiSyncOptions,
    StepOptions,
)

__all__ = [
    "SIGNATURES",
    "Bound",
    "In",
    "Out",
    "StageOut",
    "TrainPipeline",
    "bind",
    "signature_of",
]

_REQUIRED = inspect.Parameter.empty
_MODEL = (("model", _REQUIRED), ("optimizer", _REQUIRED), ("device", _REQUIRED))
_MEMORY = (
    ("enable_inplace_copy_batch", False),
    ("free_features_storage_early", False),
    ("clear_data_dist_inputs", False),
)
_RANKS = (
    ("streams", None),
    ("on_uneven", "stop"),
    ("check_keys", True),
    ("check_kjts", True),
    ("agreement", True),
    ("abort_on_error", True),
    ("failure_grace", 2.0),
    ("peer_timeout", timedelta(minutes=5)),
)
_REWRITE = (("arg_paths", None), ("rewrite_method", "auto"))
_SCHEDULE = (("input_dist_schedule", "auto"), ("tuner", None))

SIGNATURES: dict[str, tuple[tuple[tuple[str, Any], ...], tuple[tuple[str, Any], ...]]] = {
    "TrainPipelineBase": (
        (*_MODEL, ("custom_model_fwd", None), ("enable_inplace_copy_batch", False)),
        (("execute_all_batches", True), *_RANKS),
    ),
    "TrainPipelineSparseDist": (
        (
            *_MODEL,
            ("execute_all_batches", True),
            ("apply_jit", False),
            ("context_type", None),
            ("pipeline_postproc", False),
            ("custom_model_fwd", None),
            ("dmp_collection_sync_interval_batches", 1),
            ("enqueue_batch_after_forward", False),
            *_MEMORY,
        ),
        (*_REWRITE, ("strict", False), *_SCHEDULE, *_RANKS),
    ),
    "PrefetchTrainPipelineSparseDist": (
        (
            *_MODEL,
            ("execute_all_batches", True),
            ("apply_jit", False),
            ("pipeline_postproc", True),
            ("custom_model_fwd", None),
            *_MEMORY,
        ),
        (("prefetch_ahead", "auto"), *_REWRITE, ("strict", False), *_SCHEDULE, *_RANKS),
    ),
    "TrainPipelineFusedSparseDist": (
        (
            *_MODEL,
            ("execute_all_batches", True),
            ("apply_jit", False),
            ("pipeline_postproc", True),
            ("custom_model_fwd", None),
            ("strict", False),
            ("emb_lookup_stream", "data_dist"),
            ("embedding_lookup_after_data_dist", False),
            ("enable_inplace_copy_batch", False),
            ("enqueue_batch_after_forward", False),
            ("free_features_storage_early", False),
            ("clear_data_dist_inputs", False),
        ),
        (*_REWRITE, *_SCHEDULE, *_RANKS),
    ),
    "TrainPipelineSemiSync": (
        (
            *_MODEL,
            ("execute_all_batches", True),
            ("apply_jit", False),
            ("start_batch", 900),
            ("stash_gradients", False),
            ("pipeline_postproc", True),
            ("custom_model_fwd", None),
            ("strict", False),
            ("dmp_collection_sync_interval_batches", 1),
            *_MEMORY,
        ),
        (*_REWRITE, *_SCHEDULE, *_RANKS),
    ),
    "EvalPipelineSparseDist": (
        (*_MODEL, ("apply_jit", False), ("pipeline_postproc", False), *_MEMORY),
        (*_REWRITE, ("strict", False), ("input_dist_schedule", "early-shared"), *_RANKS),
    ),
    "TrainPipelinePT2": (
        (
            *_MODEL,
            ("compile_configs", None),
            ("pre_compile_fn", None),
            ("post_compile_fn", None),
            ("input_transformer", None),
        ),
        _RANKS,
    ),
    "TrainPipelineSparseDistCompAutograd": (
        (
            *_MODEL,
            ("execute_all_batches", True),
            ("apply_jit", False),
            ("context_type", None),
            ("pipeline_postproc", False),
            ("custom_model_fwd", None),
            ("free_features_storage_early", False),
            ("clear_data_dist_inputs", False),
        ),
        (("compiled_autograd_options", None), *_REWRITE, ("strict", False), *_SCHEDULE, *_RANKS),
    ),
    "SparseDataDistUtil": (
        (
            ("model", _REQUIRED),
            ("data_dist_stream", None),
            ("apply_jit", False),
            ("prefetch_stream", None),
            ("pipeline_postproc", False),
            ("embedding_lookup_stream", None),
        ),
        (*_REWRITE, ("strict", False)),
    ),
}
"""Per class: (torchrec 1.8's parameters in its order, with our defaults; our keyword-only extras)."""

_GROUPS = {
    "ranks": (RankOptions, {n: n for n, _ in _RANKS[1:]}),
    "rewrite": (
        RewriteOptions,
        {"rewrite_method": "method", "arg_paths": "arg_paths", "strict": "strict"}
        | {"pipeline_postproc": "pipeline_postproc"},
    ),
    "input_dist": (InputDistOptions, {"input_dist_schedule": "schedule", "tuner": "tuner"}),
    "prefetch": (PrefetchOptions, {"prefetch_ahead": "prefetch_ahead"}),
    "memory": (MemoryOptions, {n: n for n, _ in _MEMORY}),
    "step": (
        StepOptions,
        {n: n for n in ("enqueue_batch_after_forward", "dmp_collection_sync_interval_batches")},
    ),
    "lookup": (LookupOptions, {n: n for n in ("emb_lookup_stream", "embedding_lookup_after_data_dist")}),
    "semi_sync": (SemiSyncOptions, {n: n for n in ("start_batch", "stash_gradients")}),
    "compile": (
        CompileOptions,
        {n: n for n in ("compile_configs", "pre_compile_fn", "post_compile_fn", "input_transformer")}
        | {"compiled_autograd_options": "compiled_autograd_options"},
    ),
}
_TOP = ("execute_all_batches", "custom_model_fwd", "streams")
_CALL = ("model", "optimizer", "device", "apply_jit", "context_type")


@dataclass(kw_only=True, slots=True)
class Bound:
    """A constructor call, bound: what the class needs besides its options."""

    model: Any
    """The model the pipeline trains (or evaluates)."""
    optimizer: Any = None
    """The dense optimizer (None for SparseDataDistUtil, which has none)."""
    device: Any = None
    """Where batches are copied to (None for SparseDataDistUtil)."""
    options: PipelineOptions
    """Every other argument, as options."""
    other: dict[str, Any]
    """torchrec's parameters that belong to no options object (SparseDataDistUtil's streams)."""


def signature_of(cls: type) -> inspect.Signature | None:
    """The constructor signature of `cls` (the nearest class in its MRO that `SIGNATURES` names);
    None for the abstract classes between them and `TrainPipeline`."""
    for klass in cls.__mro__:
        if klass.__name__ in SIGNATURES:
            positional, keyword_only = SIGNATURES[klass.__name__]
            kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
            params = [inspect.Parameter(n, kind, default=d) for n, d in positional]
            kind = inspect.Parameter.KEYWORD_ONLY
            params += [inspect.Parameter(n, kind, default=d) for n, d in keyword_only]
            return inspect.Signature(params)
    return None


def bind(cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Bound:
    """Bind a constructor call of `cls` to its signature and map it onto the options.

    Raises:
        TypeError: an argument the class does not take, or a required one missing.
        ValueError: a value the options refuse (the message names the argument).
    """
    signature = signature_of(cls)
    if signature is None:
        raise TypeError(f"{cls.__name__} is abstract: build one of the pipeline classes")
    try:
        call = signature.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{cls.__name__}(): {e}") from None
    call.apply_defaults()
    values = dict(call.arguments)
    if values.get("apply_jit"):
        raise ValueError(f"{cls.__name__}: apply_jit=True is not supported (no TorchScript); leave it False")
    groups = {}
    for group, (options_type, names) in _GROUPS.items():
        given = {field: values[name] for name, field in names.items() if name in values}
        groups[group] = options_type(**given)
    top = {name: values[name] for name in _TOP if name in values}
    used = {*_TOP, *_CALL, *(n for _, names in _GROUPS.values() for n in names)}
    return Bound(
        model=values["model"],
        optimizer=values.get("optimizer"),
        device=values.get("device"),
        options=PipelineOptions(**top, **groups),
        other={k: v for k, v in values.items() if k not in used},
    )
