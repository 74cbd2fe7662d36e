"""The training loops under comparison (names: `benchmarks.spec`), each a `Runner` of one batch a step.

A `Runner` names the profiler labels around forward and around the input_dist wait inside it, so that
the profiled segment measures forward's wait the same way for every loop: ours emit
`pipeline::forward` and `pipeline::input_dist::wait`, torchrec's `## forward ##` and
`## runtime_forward_assemble_KJT ##`. Where the sharded modules run input_dist inside their own
forward (the plain loop, both Base pipelines), `labelled_input_dist` labels torchrec's `input_dist` of
this benchmark's own model, and the awaitables it returns, `bench::input_dist` in the profiled segment.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function
from torchrec.distributed.train_pipeline import train_pipelines as torchrec_pipelines
from torchrec.distributed.types import ShardedModule

import pipeline as ours
from benchmarks import bound
from benchmarks.spec import FLAGS, parse_variant

__all__ = ["Runner", "labelled_input_dist", "make_runner"]

_INLINE = "bench::input_dist"
_CLASSES = {
    "base": "TrainPipelineBase",
    "sparse-dist": "TrainPipelineSparseDist",
    "prefetch": "PrefetchTrainPipelineSparseDist",
    "semi-sync": "TrainPipelineSemiSync",
    "fused-sparse-dist": "TrainPipelineFusedSparseDist",
    "eval": "EvalPipelineSparseDist",
}
"""`ours-X` is `pipeline.<class>`, `torchrec-X` torchrec's class of the same name."""


@dataclass(kw_only=True, slots=True)
class Runner:
    """One variant, ready to train."""

    step: Callable[[Iterator[Any]], Any]
    """Trains the next batch of the iterator (a pipeline: the batch it finishes)."""
    forward_label: str = "bench::forward"
    """Prefix of the profiler label around forward."""
    wait_label: str = _INLINE
    """Prefix of the profiler label of the input_dist wait inside forward."""
    pipe: Any = None
    """The pipeline object, if any (its public `input_dist_schedule` and `tuner`, the schedule watch,
    are recorded)."""
    profile: bool = True
    """Run the profiled segment (a bound's step has nothing to label)."""

    @property
    def inline_input_dist(self) -> bool:
        """The sharded modules run input_dist in their own forward (`labelled_input_dist`)."""
        return self.wait_label == _INLINE


def make_runner(
    variant: str, model: nn.Module, optimizer: Any, device: torch.device, *, captured: bound.Captured | None
) -> Runner:
    """The `Runner` of `variant` over a freshly built model.

    Raises:
        ValueError: a bound's half without `captured` (`benchmarks.bound.capture` of the same batches).
        Exception: whatever the pipeline's constructor raises (torchrec's pipelines refuse a CPU
            device here or fail at their first step: `spec.CPU_UNSUPPORTED`).
    """
    name, schedule, flags = parse_variant(variant)
    if name == "plain":
        return Runner(step=lambda it: _train_on(model, optimizer, _to(next(it), device)))
    if name in ("compute-alone", "comm-alone", "io-alone"):
        if captured is None:
            raise ValueError(f"{variant} needs the captured inputs of benchmarks.bound.capture")
        if name == "compute-alone":
            bound.warm(model)  # tables on disk: every row cached, no step reads the disk
            step = bound.compute_alone(model, optimizer, device, captured)
        elif name == "io-alone":
            step = bound.io_alone(model, captured)
        else:
            step = bound.comm_alone(model, device, captured)
        return Runner(step=step, profile=False)
    if name == "ours-staged":
        return Runner(step=_staged_step(model, optimizer, device), wait_label="pipeline::input_dist::wait")
    options: dict[str, Any] = {}
    grouped: dict[str, dict[str, Any]] = {"input_dist": {"schedule": schedule}} if schedule else {}
    for key, value in (item for flag in flags for item in FLAGS[flag].items()):
        group, _, field = key.rpartition(".")
        if group:
            grouped.setdefault(group, {})[field] = value
        else:
            options[key] = value
    kinds = {"ranks": ours.RankOptions, "input_dist": ours.InputDistOptions, "prefetch": ours.PrefetchOptions}
    options.update({group: kinds[group](**fields) for group, fields in grouped.items()})
    if name.endswith("semi-sync"):
        options["start_batch"] = 0  # semi-synchronous from the first batch
    if name.endswith("-eval"):
        model.eval()  # forward only; every run builds a fresh model
    library, kind = name.split("-", 1)
    cls = getattr(ours if library == "ours" else torchrec_pipelines, _CLASSES[kind])
    pipe = cls(model, optimizer, device, **options)
    if name.startswith("ours-"):
        forward, wait = "pipeline::forward", "pipeline::input_dist::wait"
    else:
        forward, wait = "## forward", "## runtime_forward_assemble_KJT"
    wait = _INLINE if name.endswith("-base") else wait  # Base: input_dist inside the modules' forward
    return Runner(step=pipe.progress, pipe=pipe, forward_label=forward, wait_label=wait)


def _to(batch: Any, device: torch.device) -> Any:
    # On CPU a copy to the device is no copy: skip the walk over the batch, as our pipelines do.
    return batch if device.type == "cpu" else batch.to(device=device, non_blocking=True)


def _train_on(model: nn.Module, optimizer: Any, batch: Any) -> Any:
    """The plain loop's step on one batch already on the device; its output."""
    optimizer.zero_grad()
    with record_function("bench::forward"):
        loss, output = model(batch)
    (loss if loss.dim() == 0 else torch.sum(loss)).backward()
    optimizer.step()
    return output


def _staged_step(model: nn.Module, optimizer: Any, device: torch.device) -> Callable[[Iterator[Any]], Any]:
    sdd = ours.SparseDataDistUtil(model)
    pipe = ours.StagedTrainPipeline(
        [ours.PipelineStage("data_copy", lambda b: _to(b, device)), sdd.start_sparse_data_dist_stage()]
    )

    def step(batches: Iterator[Any]) -> Any:
        batch = pipe.progress(batches)
        if batch is None:
            raise StopIteration
        return _train_on(model, optimizer, batch)

    return step


@contextmanager
def labelled_input_dist(model: nn.Module) -> Iterator[None]:
    """Label every sharded module's inline input_dist (launch and both waits) `bench::input_dist`.

    Only for loops whose sharded modules run their own forward: a pipeline that calls `input_dist`
    itself inspects the awaitable it returns, which the wrapper would hide.
    """
    modules = [m for m in model.modules() if isinstance(m, ShardedModule)]
    for module in modules:
        module.input_dist = _labelled(module.input_dist)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for module in modules:
            del module.input_dist  # the instance attribute; the class's method shows again


def _labelled(input_dist: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> _LabelledAwaitable:
        with record_function(_INLINE):
            return _LabelledAwaitable(input_dist(*args, **kwargs), levels=2)

    return wrapped


class _LabelledAwaitable:
    """Waits under the `bench::input_dist` label, `levels` nested awaitables deep."""

    def __init__(self, inner: Any, levels: int) -> None:
        self._inner, self._levels = inner, levels

    def wait(self) -> Any:
        with record_function(_INLINE):
            result = self._inner.wait()
        return _LabelledAwaitable(result, self._levels - 1) if self._levels > 1 else result
