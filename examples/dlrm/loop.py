"""The training loop, callable without torchrun: `train(config, ...)` in an initialized process
group returns this rank's per-step losses and the run's summary.

Every `--pipeline` value goes through the same loop; only the runner differs. Eval reuses the
training runner: the model is switched to eval mode, the runner is given the eval iterator until it
raises StopIteration, and the model is switched back to training with the train iterator.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torchrec.datasets.utils import Batch

from examples.dlrm.checkpoint import Checkpoints, Position
from examples.dlrm.config import InputError, TrainConfig
from examples.dlrm.data import DataSources, make_sources
from examples.dlrm.digest import state_digest
from examples.dlrm.faults import LossLog
from examples.dlrm.model import ShardedDLRM, build_model
from examples.dlrm.profiling import step_profiler
from examples.dlrm.report import Reporter
from examples.dlrm.runners import Runner, describe_pipeline, make_runner, running_mode, unwrap
from examples.dlrm.store import cache_summary, guard_cache

__all__ = ["TrainResult", "train"]


@dataclass(kw_only=True, slots=True)
class TrainResult:
    """What one rank's run produced."""

    losses: list[float]
    """This rank's training loss at every step, in order."""
    eval_losses: list[list[float]]
    """This rank's loss at every batch of every eval pass."""
    summary: dict[str, Any]
    """Figures for the run; loss, AUC and throughput are reduced over all ranks, `profile` is this
    rank's trace."""


def train(
    config: TrainConfig,
    *,
    rank: int,
    world_size: int,
    device: torch.device,
    local_world_size: int | None = None,
) -> TrainResult:
    """Train DLRM as `config` says; every rank of the default process group must call it.

    Raises:
        InputError: bad configuration for this world size, or bad data.
    """
    started = time.perf_counter()
    sources = make_sources(config, rank=rank, world_size=world_size)
    sharded = build_model(
        config, device=device, world_size=world_size, local_world_size=local_world_size or 1
    )
    runner = make_runner(
        config.pipeline,
        sharded.model,
        sharded.optimizer,
        device,
        input_dist_schedule=config.input_dist_schedule,
        prefetch_ahead=config.prefetch_ahead,
    )
    if config.embedding_store is not None:
        runner = guard_cache(runner, config)
    per_epoch = sources.steps_per_epoch
    if torch.distributed.is_initialized():  # every rank starts the clock together: first_step_ms
        torch.distributed.barrier()  # must not count a peer still building its model
    reporter = Reporter(
        config,
        rank=rank,
        device=device,
        total_steps=per_epoch * config.epochs if per_epoch else None,
    )
    reporter.write(f"dlrm: {world_size} rank(s) on {device.type}, {sharded.plan}")
    resume = _resume(config, sharded, watch=getattr(unwrap(runner), "tuner", None), rank=rank)
    start, saves = resume.start, resume.saves
    if start.path is not None:
        reporter.write(f"dlrm: resumed from {start.path} (step {start.step})")
    with step_profiler(
        config.profile_dir,
        rank=rank,
        device=device,
        skip=config.warmup_steps,
        active=config.profile_steps,
        describe=lambda: running_mode(runner),
    ) as profiler_step:
        try:
            _run_epochs(config, runner, sharded.model, sources, reporter, profiler_step, resume)
        except BaseException:
            reporter.close()  # an error message must not be glued to the progress bar
            raise
    tiered = config.embedding_store is not None
    summary: dict[str, Any] = {
        "pipeline": config.pipeline,
        "device": device.type,
        "world_size": world_size,
        "sharding": sharded.plan,
        **describe_pipeline(runner),
        **reporter.finish(),
        **(cache_summary(sharded.model, device) if tiered else {}),
        **(_checkpoint_summary(start, saves) if saves is not None else {}),
        "state_digest": state_digest(sharded.model, sharded.optimizer, tiered=tiered),
        "total_seconds": round(time.perf_counter() - started, 3),
    }
    if config.profile_dir is not None:
        trace = Path(config.profile_dir) / f"rank{rank}.json"
        summary["profile"] = (
            str(trace) if trace.exists() else f"no trace: the run ended before step {config.warmup_steps + 2}"
        )
    return TrainResult(
        losses=reporter.losses,
        eval_losses=reporter.eval_losses,
        summary=summary,
    )


@dataclass(slots=True)
class _Resume:
    """Where the run starts, and what saves and logs its steps (`--checkpoint-dir`, `--loss-log`)."""

    start: Position
    saves: Checkpoints | None
    log: LossLog | None


def _resume(config: TrainConfig, sharded: ShardedDLRM, *, watch: Any, rank: int) -> _Resume:
    """Load the newest checkpoint (with `checkpoint_dir`), and the schedule watch's decision saved
    with it; a collective."""
    log = LossLog(config.loss_log, rank=rank) if config.loss_log else None
    if config.checkpoint_dir is None:
        return _Resume(Position(), None, log)
    saves = Checkpoints(
        config, model=sharded.model, optimizer=sharded.optimizer, plan=sharded.plan, log=log, watch=watch
    )
    if log is not None:
        log.event("built", 0)  # model sharded, checkpoint not yet read
    start = saves.resume()
    if log is not None:
        log.event("resumed", start.step)
    return _Resume(start, saves, log)


def _run_epochs(
    config: TrainConfig,
    runner: Runner,
    model: nn.Module,
    sources: DataSources,
    reporter: Reporter,
    profiler_step: Callable[[], None],
    resume: _Resume,
) -> None:
    step = evaluated_at = resume.start.step
    for epoch in range(resume.start.epoch, config.epochs):
        epoch_start = step
        first = resume.start.batch if epoch == resume.start.epoch else 0
        train_iter = sources.train(epoch, first)
        while True:
            try:
                output = runner.progress(train_iter)
            except StopIteration:
                break
            step += 1
            reporter.train_step(output)
            if resume.log is not None:
                resume.log.step(step, output[0].item())
            profiler_step()
            if resume.saves is not None:
                resume.saves.after_step(step, runner, train_iter)
            if sources.eval and step % config.eval_every == 0:
                _evaluate(runner, model, sources.eval(), reporter)
                evaluated_at = step
        if step == epoch_start and first == 0:
            raise InputError(
                f"epoch {epoch} has no complete batch: the training data must hold at least "
                f"--batch-size ({config.batch_size}) lines",
                every_rank=True,
            )
    if resume.saves is not None:
        resume.saves.save(Position(step=step, epoch=config.epochs))
        resume.saves.wait()
    if sources.eval and evaluated_at != step:
        _evaluate(runner, model, sources.eval(), reporter)


def _checkpoint_summary(start: Position, saves: Checkpoints) -> dict[str, Any]:
    seconds = saves.save_seconds
    return {
        "resumed_from_step": start.step,
        "checkpoints_saved": len(seconds),
        "checkpoint_save_ms": round(1000 * sum(seconds) / len(seconds), 1) if seconds else None,
    }


def _evaluate(runner: Runner, model: nn.Module, eval_iter: Iterator[Batch], reporter: Reporter) -> None:
    outputs = []
    with reporter.paused():
        model.eval()
        try:
            while True:
                try:
                    outputs.append(_eval_output(runner.progress(eval_iter)))
                except StopIteration:
                    break
        finally:
            model.train()
    if not outputs:
        raise InputError(
            "the eval data has no complete batch: it must hold at least --batch-size lines", every_rank=True
        )
    reporter.eval_pass(outputs)


def _eval_output(result: Any) -> Any:
    # In eval mode torchrec's pipelines return the model's output, (loss, logits, labels) for
    # DLRMTrain, while `pipeline`'s pass the model's whole (loss, output) through: accept both.
    if isinstance(result, tuple) and len(result) == 2:
        return result[1]
    return result
