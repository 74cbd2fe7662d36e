"""Gradient accumulation around any pipeline, with torchrec 1.8's API and schedule: one optimizer step
every `num_steps` batches (docs/reference.md, "Gradient accumulation", says each rule)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Generic

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from pipeline.compat import In, Out

__all__ = ["GradientAccumulationConfig", "GradientAccumulationWrapper"]


@dataclass(slots=True)
class GradientAccumulationConfig:
    """How many batches make one optimizer step (torchrec's fields and defaults, positional too).

    Raises:
        ValueError: `num_steps` or `num_warmup_steps` below 1.
    """

    is_enabled: bool = False  # set by itself when num_steps > 1
    num_steps: int = 1  # batches per optimizer step
    num_warmup_steps: int = 1  # the first this many batches sync (DDP's static_graph needs the first)

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1; got {self.num_steps}")
        if self.num_warmup_steps < 1:
            raise ValueError(
                f"num_warmup_steps must be >= 1 (DDP with static_graph syncs its first backward); "
                f"got {self.num_warmup_steps}"
            )
        if self.num_steps > 1:
            self.is_enabled = True


class AccumulatingOptimizer:
    """The optimizer as the wrapped pipeline sees it: `zero_grad()` at a group's first batch only,
    `step()` at its last only; the rest is the optimizer's."""

    def __init__(self, optimizer: Any, config: GradientAccumulationConfig) -> None:
        self.optimizer = optimizer
        self.config = config
        self.current_step = 0
        self.needs_zero_grad = True

    def ends_group(self) -> bool:
        return (self.current_step + 1) % self.config.num_steps == 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.needs_zero_grad:
            self.optimizer.zero_grad(set_to_none=set_to_none)
            self.needs_zero_grad = False

    def step(self, *args: Any, **kwargs: Any) -> Any:
        if not self.ends_group():
            return None
        self.needs_zero_grad = True
        return self.optimizer.step(*args, **kwargs)

    def flush(self) -> None:
        """Step with what the unfinished group accumulated, and clear it."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.needs_zero_grad = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


class GradientAccumulationWrapper(Generic[In, Out]):
    """Runs `pipeline` with one optimizer step every `config.num_steps` batches (torchrec's API).

    Args:
        pipeline: a pipeline of ours (or torchrec's) built with `optimizer`.
        optimizer: the optimizer the pipeline steps.
        model: the model the pipeline trains (its DDP modules get `no_sync()`).
        config: the accumulation; disabled, `progress()` is the pipeline's.
    """

    def __init__(
        self, pipeline: Any, optimizer: Any, model: torch.nn.Module, config: GradientAccumulationConfig
    ) -> None:
        self._pipeline = pipeline
        self._model = model
        self._config = config
        self._optimizer = AccumulatingOptimizer(optimizer, config)
        self._ddp: list[Any] | None = None
        self._synced_last = True
        if config.is_enabled:  # ours step a public `optimizer`; torchrec's classes a private `_optimizer`
            if isinstance(getattr(type(pipeline), "optimizer", None), property):
                pipeline.optimizer = self._optimizer
            elif hasattr(pipeline, "_optimizer"):
                pipeline._optimizer = self._optimizer
            else:
                raise TypeError(f"{type(pipeline).__name__} has no optimizer to accumulate for")

    @property
    def optimizer_wrapper(self) -> AccumulatingOptimizer:
        """The optimizer the pipeline steps (it steps the real one at a group's end)."""
        return self._optimizer

    @property
    def current_step(self) -> int:
        """How many batches have been trained (the index of the next one)."""
        return self._optimizer.current_step

    def set_step(self, step: int) -> None:
        """Set the batch counter (to resume a run mid-group from a checkpoint)."""
        self._optimizer.current_step = step

    def progress(self, dataloader_iter: Iterator[In], is_last_batch: bool | None = None) -> Out:
        """One batch through the pipeline; the optimizer steps if it ends a group.

        Args:
            is_last_batch: True for the last batch: it syncs, and the group steps after it.

        Raises:
            StopIteration: the dataloader is exhausted; an unfinished group stepped first.
        """
        if not self._config.is_enabled:
            return self._pipeline.progress(dataloader_iter)
        warmup = self.current_step < self._config.num_warmup_steps
        sync = bool(is_last_batch) or warmup or self._optimizer.ends_group()
        try:
            with contextlib.ExitStack() as no_sync:
                for ddp in [] if sync else self._ddp_modules():
                    no_sync.enter_context(ddp.no_sync())
                output = self._pipeline.progress(dataloader_iter)
        except StopIteration:
            self._flush()
            raise
        self._synced_last = sync
        self._optimizer.current_step += 1
        if is_last_batch:
            self._flush()
        return output

    def drain(self, dataloader_iter: Iterator[In]) -> list[Out]:
        """Refused: the pipeline's `drain()` would run batches past the accumulation's count.

        Raises:
            TypeError: always; checkpoint at a group's boundary (`current_step % num_steps == 0`)
                with the pipeline's `dataloader_state()` instead, and save `current_step`.
        """
        raise TypeError(
            "GradientAccumulationWrapper.drain() is not supported: checkpoint when current_step is a "
            "multiple of num_steps, with dataloader_state() (no drain), and restore with set_step()"
        )

    def reset(self) -> None:
        """Start counting from 0 with cleared gradients, and reset the pipeline."""
        self._optimizer.current_step = 0
        self._optimizer.needs_zero_grad = True
        self._synced_last = True
        if hasattr(self._pipeline, "reset"):
            self._pipeline.reset()

    def _flush(self) -> None:
        """Step an unfinished group, its gradients first averaged over the ranks if it did not sync."""
        done = self.current_step
        if done % self._config.num_steps == 0:
            return
        if not self._synced_last:
            # DDP only: FSDP's gradients are sharded (it then steps unsynced there, as torchrec's)
            for ddp in self._ddp_modules():
                if isinstance(ddp, DistributedDataParallel):
                    _average_gradients(ddp)
            self._synced_last = True
        self._optimizer.flush()
        # unlike torchrec 1.8, the next epoch's first batch starts a group instead of ending one
        self._optimizer.current_step = done + self._config.num_steps - done % self._config.num_steps

    def _ddp_modules(self) -> list[Any]:
        """The model if it has `no_sync` (DDP, FSDP), else every DDP in it; found once."""
        if self._ddp is None:
            ddps = [m for m in self._model.modules() if isinstance(m, DistributedDataParallel)]
            self._ddp = [self._model] if hasattr(self._model, "no_sync") else ddps
        return self._ddp

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipeline, name)  # rewrite_report, dataloader_state, ...


def _average_gradients(ddp: Any) -> None:
    """What a synced backward does to the gradients: divide by the group's size, sum over its ranks."""
    group = getattr(ddp, "process_group", None)
    size = dist.get_world_size(group)
    ignored = getattr(ddp, "parameters_to_ignore", set())
    for name, param in ddp.module.named_parameters():
        if param.grad is None or name in ignored:
            continue
        param.grad.div_(size)
        dist.all_reduce(param.grad, group=group)
