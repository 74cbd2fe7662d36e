"""The training loops under comparison, each as a `Runner` with one `step(iterator)` per batch.

Variants: `plain` (copy, zero_grad, forward, backward, step), this library's `ours-base`,
`ours-sparse-dist` and `ours-prefetch`, and torchrec 1.8's `torchrec-base`, `torchrec-sparse-dist` and
`torchrec-prefetch`; on request the rest of the family (`benchmarks.spec.FAMILY_VARIANTS`): Fused,
SemiSync and Eval, ours and torchrec's, and our StagedTrainPipeline. A `Runner` also names the
profiler labels that delimit forward and the input_dist wait inside it, which differ between the
libraries, so the profiled segment can measure "time forward spends waiting on input_dist" for
every variant the same way.

Where a variant runs input_dist inside forward (the plain loop and both Base pipelines, whose
sharded modules keep their own forward), `timed_input_dist` wraps each sharded module's `input_dist`
and the two awaitables it returns in `bench::input_dist` labels during the profiled segment: the
whole all-to-all (launch, splits wait, values wait) then counts as forward's input_dist time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function
from torchrec.distributed import train_pipeline as torchrec_pipelines
from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSemiSync
from torchrec.distributed.types import ShardedModule

import pipeline as ours
from benchmarks import bound, disk_bound
from benchmarks.spec import (
    ALL_VARIANTS,
    CAPTURING_VARIANTS,
    FORCED_VARIANTS,
    MEMORY_FLAGS,
    PREFETCH_FORCED_VARIANTS,
)

__all__ = ["INLINE_WAIT", "Runner", "make_runner", "timed_input_dist"]

INLINE_WAIT = "bench::input_dist"

_PIPELINES: dict[str, Callable[..., Any]] = {
    "ours-base": ours.TrainPipelineBase,
    "ours-sparse-dist": ours.TrainPipelineSparseDist,
    "ours-prefetch": ours.PrefetchTrainPipelineSparseDist,
    "torchrec-base": torchrec_pipelines.TrainPipelineBase,
    "torchrec-sparse-dist": torchrec_pipelines.TrainPipelineSparseDist,
    "torchrec-prefetch": torchrec_pipelines.PrefetchTrainPipelineSparseDist,
    "ours-fused-sparse-dist": ours.TrainPipelineFusedSparseDist,
    "torchrec-fused-sparse-dist": torchrec_pipelines.TrainPipelineFusedSparseDist,
    "ours-semi-sync": ours.TrainPipelineSemiSync,
    "torchrec-semi-sync": TrainPipelineSemiSync,
    "ours-eval": ours.EvalPipelineSparseDist,
    "torchrec-eval": torchrec_pipelines.EvalPipelineSparseDist,
}
_OPTIONS: dict[str, dict[str, Any]] = {
    "ours-semi-sync": {"start_batch": 0},
    "torchrec-semi-sync": {"start_batch": 0},
}
"""Constructor options per variant: SemiSync semi-synchronous from the first batch."""
_TORCHREC_FORWARD = "## forward"
_TORCHREC_WAIT = "## runtime_forward_assemble_KJT"


@dataclass(kw_only=True, slots=True)
class Runner:
    """One variant, ready to train."""

    step: Callable[[Iterator[Any]], Any]
    """Trains the next batch of the iterator (through the pipeline: the batch it finishes)."""
    forward_label: str
    """Prefix of the profiler label around forward."""
    wait_label: str
    """Prefix of the profiler label of input_dist waiting inside forward."""
    inline_input_dist: bool
    """The sharded modules run input_dist inside their own forward (wrap with `timed_input_dist`)."""
    schedule: Callable[[], str | None] = lambda: None
    """Our SparseDist/Prefetch: the input_dist schedule in use (see `pipeline.stages.schedule`); None
    for the others."""
    tuner: Callable[[], Any] = lambda: None
    """Our SparseDist/Prefetch under "auto": the `pipeline.stages.schedule.Tuner`; None otherwise."""
    profile: bool = True
    """Run the profiled segment (the bound's step functions have nothing to label)."""


def make_runner(
    variant: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    *,
    captured: bound.Captured | None = None,
) -> Runner:
    """The `Runner` of `variant` over a freshly built model.

    `ours-sparse-dist@<schedule>` forces `input_dist_schedule`; `compute-alone`, `comm-alone` and
    `io-alone` need `captured` (`benchmarks.bound.capture` on the same config and batches).

    Raises:
        ValueError: unknown variant.
        Exception: whatever the pipeline's constructor raises (torchrec's Prefetch pipeline may
            refuse a CPU device here or fail on its first step).
    """
    if variant == "plain":
        return Runner(
            step=_plain_step(model, optimizer, device),
            forward_label="bench::forward",
            wait_label=INLINE_WAIT,
            inline_input_dist=True,
        )
    if variant in CAPTURING_VARIANTS:
        if captured is None:
            raise ValueError(f"{variant} needs the captured inputs of benchmarks.bound.capture")
        if variant == "compute-alone":
            disk_bound.warm(model)  # tables on disk: every row cached (benchmarks.disk_bound)
            step = bound.compute_alone(model, optimizer, device, captured)
        elif variant == "io-alone":
            step = disk_bound.io_alone(model, captured)
        else:
            step = bound.comm_alone(model, device, captured)
        return Runner(step=step, forward_label="-", wait_label="-", inline_input_dist=False, profile=False)
    options: dict[str, Any] = {}
    if variant.endswith("+novote"):
        variant = variant.removesuffix("+novote")
        options.update(agreement=False, check_keys=False, check_kjts=False)
    for suffix, flag in MEMORY_FLAGS.items():
        if variant.endswith(suffix):
            variant = variant.removesuffix(suffix)
            options[flag] = True
    if variant in FORCED_VARIANTS or variant in PREFETCH_FORCED_VARIANTS:
        variant, options["input_dist_schedule"] = variant.split("@")
    if variant == "ours-staged":
        return Runner(
            step=_staged_step(model, optimizer, device),
            forward_label="bench::forward",
            wait_label="pipeline::input_dist::wait",
            inline_input_dist=False,
        )
    if variant not in _PIPELINES:
        raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(ALL_VARIANTS)}")
    if variant.endswith("-eval"):
        model.eval()  # forward only; the worker builds a fresh model for each run
    pipe = _PIPELINES[variant](model, optimizer, device, **options, **_OPTIONS.get(variant, {}))
    base = variant.endswith("-base")
    if variant.startswith("ours-"):
        forward, wait = "pipeline::forward", "pipeline::input_dist::wait"
    else:
        forward, wait = _TORCHREC_FORWARD, _TORCHREC_WAIT
    return Runner(
        step=pipe.progress,
        forward_label=forward,
        wait_label=INLINE_WAIT if base else wait,
        inline_input_dist=base,
        schedule=lambda: getattr(pipe, "input_dist_schedule", None),
        tuner=lambda: getattr(pipe, "tuner", None),
    )


def _plain_step(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device):
    def step(batches: Iterator[Any]) -> Any:
        return _train_on(model, optimizer, next(batches).to(device=device, non_blocking=True))

    return step


def _train_on(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any) -> Any:
    """The plain loop's step on one batch (already on the device); the output."""
    optimizer.zero_grad()
    with record_function("bench::forward"):
        loss, output = model(batch)
    torch.sum(loss).backward()
    optimizer.step()
    return output


def _staged_step(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device):
    sdd = ours.SparseDataDistUtil(model)
    pipe = ours.StagedTrainPipeline(
        [
            ours.PipelineStage("data_copy", lambda batch: batch.to(device=device, non_blocking=True)),
            sdd.start_sparse_data_dist_stage(),
        ]
    )

    def step(batches: Iterator[Any]) -> Any:
        batch = pipe.progress(batches)
        if batch is None:
            raise StopIteration
        return _train_on(model, optimizer, batch)

    return step


@contextmanager
def timed_input_dist(model: nn.Module) -> Iterator[None]:
    """Label every sharded module's inline input_dist (launch and both waits) `bench::input_dist`.

    Only for variants whose sharded modules run their own forward: a pipeline that calls
    `input_dist` itself inspects the awaitable it returns, which the wrapper hides.
    """
    modules = [m for m in model.modules() if isinstance(m, ShardedModule)]
    for module in modules:
        module.input_dist = _labelled(module.input_dist)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for module in modules:
            del module.input_dist  # the instance attribute; the class method shows again


def _labelled(input_dist: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> _LabelledAwaitable:
        with record_function(INLINE_WAIT):
            return _LabelledAwaitable(input_dist(*args, **kwargs), levels=2)

    return wrapped


class _LabelledAwaitable:
    """Waits under the `bench::input_dist` label; `levels` nested awaitables deep."""

    def __init__(self, inner: Any, levels: int) -> None:
        self._inner = inner
        self._levels = levels

    def wait(self) -> Any:
        with record_function(INLINE_WAIT):
            result = self._inner.wait()
        return _LabelledAwaitable(result, self._levels - 1) if self._levels > 1 else result
