"""One object per `--pipeline` value with the pipelines' `progress(dataloader_iter)` API.

`none` is the plain loop, written out here; the others are the `pipeline` package's classes. That
package is imported only when one of them is asked for, so the plain loop keeps working while the
package is missing or broken.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import nn
from torchrec.datasets.utils import Batch

from examples.dlrm.config import InputError

__all__ = [
    "PIPELINE_CLASSES",
    "PlainLoop",
    "Runner",
    "describe_pipeline",
    "make_runner",
    "running_mode",
    "unwrap",
]

PIPELINE_CLASSES = {
    "base": "TrainPipelineBase",
    "sparse-dist": "TrainPipelineSparseDist",
    "prefetch": "PrefetchTrainPipelineSparseDist",
}


class Runner(Protocol):
    """Anything that trains (or, with the model in eval mode, evaluates) one batch per call."""

    def progress(self, dataloader_iter: Iterator[Batch]) -> Any:
        """Run the next batch and return the model's output for it.

        Raises:
            StopIteration: every batch of `dataloader_iter` has been run.
        """
        ...

    def dataloader_state(self, dataloader_iter: Iterator[Batch]) -> Any:
        """`dataloader_iter.state_dict()` as of the oldest batch fetched and not yet trained."""
        ...


class PlainLoop:
    """The reference loop: `loss, out = model(batch); loss.backward(); opt.step(); opt.zero_grad()`.

    In eval mode it runs the forward only, under `no_grad`.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device):
        self._model = model
        self._optimizer = optimizer
        self._device = device

    def progress(self, dataloader_iter: Iterator[Batch]) -> Any:
        """Train on (or evaluate) the next batch and return the model's output for it."""
        batch = next(dataloader_iter).to(self._device)
        if not self._model.training:
            with torch.no_grad():
                return self._model(batch)[1]
        loss, out = self._model(batch)
        loss.backward()
        self._optimizer.step()
        self._optimizer.zero_grad()
        return out

    def dataloader_state(self, dataloader_iter: Any) -> Any:
        """The iterator's own state: this loop fetches nothing ahead."""
        return dataloader_iter.state_dict()


def make_runner(
    name: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    *,
    input_dist_schedule: str = "adaptive",
    prefetch_ahead: str = "auto",
) -> Runner:
    """The runner for `--pipeline name` (`input_dist_schedule` for the classes that have one,
    `prefetch_ahead`, "auto", "true" or "false", for `prefetch`).

    Raises:
        InputError: the `pipeline` package is not installed or lacks the class for `name`.
    """
    if name == "none":
        return PlainLoop(model, optimizer, device)
    class_name = PIPELINE_CLASSES[name]
    try:
        import pipeline
    except ModuleNotFoundError as e:
        if e.name != "pipeline":
            raise
        raise InputError(
            f"--pipeline {name} needs the `pipeline` package of this repository; install it with "
            f"`make setup` (or `pip install -e .`), or use --pipeline none"
        ) from e
    cls = getattr(pipeline, class_name, None)
    if cls is None:
        raise InputError(
            f"--pipeline {name} needs `pipeline.{class_name}`, which the installed `pipeline` "
            f"package does not provide (yet); use --pipeline none"
        )
    if name == "base":
        return cls(model, optimizer, device)
    input_dist = pipeline.InputDistOptions(schedule=input_dist_schedule)
    if name == "prefetch":
        ahead = {"auto": "auto", "true": True, "false": False}[prefetch_ahead]
        prefetch = pipeline.PrefetchOptions(prefetch_ahead=ahead)
        return cls(model, optimizer, device, input_dist=input_dist, prefetch=prefetch)
    return cls(model, optimizer, device, input_dist=input_dist)


def unwrap(runner: Runner) -> Any:
    """The pipeline (or plain loop) behind `runner` (`examples.dlrm.store`'s cache guard wraps it)."""
    return getattr(runner, "runner", runner)


def describe_pipeline(runner: Runner) -> dict[str, str]:
    """What the pipeline behind `runner` chose, for the summary: `input_dist_schedule` (under the
    default, "adaptive", what its watch saw and did) and `rewrite` (which sharded modules are
    pipelined). Empty for the plain loop."""
    pipe = unwrap(runner)
    found: dict[str, str] = {}
    schedule = getattr(pipe, "input_dist_schedule", None)
    if schedule is not None:
        watch = pipe.tuner  # the default's schedule watch, or None where the schedule is pinned
        if watch is None:
            found["input_dist_schedule"] = f"{schedule} (fixed)"
        elif watch.reason is None and watch.share is not None:
            found["input_dist_schedule"] = (
                f"{schedule} (adaptive: watching; the host blocked on the input all-to-alls "
                f"{watch.share:.0%} of the step on this rank)"
            )
        else:
            found["input_dist_schedule"] = f"{schedule} (adaptive: {watch.reason or 'watching'})"
    report = getattr(pipe, "rewrite_report", None)
    if report is not None:
        done = [f"{m.fqn} ({m.method}: {m.path})" for m in report.modules if m.pipelined]
        left = [f"{m.fqn} ({m.reason})" for m in report.not_pipelined]
        found["rewrite"] = "; ".join(
            [
                f"pipelined {', '.join(done) or 'nothing'}",
                *([f"not pipelined {', '.join(left)}"] if left else []),
            ]
        )
    return found


def running_mode(runner: Runner) -> dict[str, str]:
    """How the pipeline behind `runner` runs its steps now, read from the pipeline object (not from
    the flags it was given, so that it cannot say what did not run): its class; with a prefetch
    stage, `prefetch` ("ahead" or "inline") and `prefetch_by` ("pinned": no watch, or "watch: " and
    its phase); with an input_dist ahead, `input_dist_schedule` and `schedule_by` ("pinned", "watch:
    " and its phase, or "tuner: tuning"/"tuner: decided"). The profiler records it at every traced
    step (`examples.dlrm.profiling`), and `python -m timeline` says it beside each run."""
    pipe = unwrap(runner)
    mode = {"pipeline": type(pipe).__name__}
    stage = getattr(pipe, "prefetch_mode", None)  # None before the first batch
    if stage == "prefetch":
        watch = pipe.prefetch_watch
        mode["prefetch"] = "ahead" if pipe.prefetch_ahead else "inline"
        mode["prefetch_by"] = "pinned" if watch is None else f"watch: {watch.phase.value}"
    elif stage == "sparse-dist":
        mode["prefetch"], mode["prefetch_by"] = "none", "no module's prefetch() moves data"
    schedule = getattr(pipe, "input_dist_schedule", None)
    if schedule is not None:
        tuner = pipe.tuner
        mode["input_dist_schedule"] = schedule
        if tuner is None:
            mode["schedule_by"] = "pinned"
        elif hasattr(tuner, "phase"):  # the default's schedule watch
            mode["schedule_by"] = f"watch: {tuner.phase.value}"
        else:
            mode["schedule_by"] = f"tuner: {'tuning' if tuner.tuning else 'decided'}"
    return mode
