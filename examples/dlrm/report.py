"""What a user sees while DLRM trains: a progress bar, loss/AUC/throughput every few steps, eval
results, and the final summary.

Only rank 0 prints, but every rank must call the same methods at the same steps: loss and AUC are
reduced over all ranks with collectives. Per-step losses stay on the device until a report, so
that training does not wait for the device once per step.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from examples.dlrm.config import TrainConfig

__all__ = ["BinnedAUC", "Reporter"]

# Binned AUC keeps a fixed-size state, so syncing it is one small collective however many samples
# it saw; 200 thresholds put its error well below run-to-run noise.
_AUC_BINS = 200


class BinnedAUC:
    """The area under the ROC curve of every rank's scores (the sigmoid of the logits) at `_AUC_BINS`
    thresholds from 0 to 1, by the trapezoidal rule: the value torchmetrics' `BinaryAUROC(thresholds=
    200)` gives, computed here so that the example imports neither torchmetrics nor, through it,
    matplotlib (which writes a font cache under HOME and starts `fc-list`)."""

    def __init__(self, device: torch.device) -> None:
        self._thresholds = torch.linspace(0, 1, _AUC_BINS, device=device)
        self._counts = torch.zeros(2, _AUC_BINS + 1, dtype=torch.int64, device=device)
        """[label, j]: the scores of that label with exactly j thresholds at or below them."""

    @torch.no_grad()
    def update(self, scores: torch.Tensor, labels: torch.Tensor) -> None:
        scores = scores.flatten().to(self._thresholds.dtype).contiguous()
        below = torch.searchsorted(self._thresholds, scores, right=True)
        index = labels.flatten().long() * (_AUC_BINS + 1) + below
        self._counts += torch.bincount(index, minlength=2 * (_AUC_BINS + 1)).view(2, -1)

    @torch.no_grad()
    def compute(self) -> torch.Tensor:
        """Over every rank's scores since the last `reset` (a collective where a group is initialized)."""
        counts = self._counts.clone()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts)
        # a score is at or above threshold k when more than k thresholds are at or below it
        at_or_above = counts.flip(1).cumsum(1).flip(1)[:, 1:]
        totals = counts.sum(1, keepdim=True).clamp(min=1)  # no scores of a label: its rate is 0
        fpr, tpr = (at_or_above.float() / totals.float()).flip(1)
        return torch.trapz(tpr, fpr)

    def reset(self) -> None:
        self._counts.zero_()


class Reporter:
    """Collects each step's output and reports on rank 0.

    Args:
        config: the run; `log_every`, `warmup_steps`, `batch_size` and `show_progress` are used.
        rank: this rank.
        device: where the model's outputs live.
        total_steps: training steps planned, for the progress bar; None when unknown.
    """

    def __init__(
        self,
        config: TrainConfig,
        *,
        rank: int,
        device: torch.device,
        total_steps: int | None,
    ) -> None:
        self._config = config
        self._device = device
        self._verbose = rank == 0 and config.show_progress
        self._bar = tqdm(total=total_steps, unit="step", disable=not self._verbose, mininterval=0.5)
        self._train_auc = BinnedAUC(device)
        self._eval_auc = BinnedAUC(device)
        self.losses: list[float] = []
        """This rank's loss at every reported training step, on the host (`finish` reports the last)."""
        self._unreported: list[torch.Tensor] = []
        """The losses since the last report, still on the device: a report moves them to `losses`, so
        the device holds one interval's, however long the run."""
        self.eval_losses: list[list[float]] = []
        """This rank's loss at every batch of every eval pass."""
        self._step = 0
        self._started = time.perf_counter()
        self._interval_start = self._started
        self._measure_start: float | None = None  # end of warm-up
        self._paused_seconds = 0.0  # paused since warm-up, left out of throughput
        self._step_end: float | None = None  # end of the previous step, once timing has begun
        self._paused_in_step = 0.0  # paused since then: an eval pass is not part of a step
        self.step_seconds: list[float] = []
        """Wall time of each timed step (after the warm-up): from the end of the previous step to the
        end of this one, eval passes left out. Its median is the summary's `step_time_ms`."""
        self._last: dict[str, float] = {}
        self._first_step: float | None = None
        """Seconds from the start of training to the end of the first step (the pipeline's fill
        and first-batch work included): the summary's `first_step_ms`."""

    def train_step(self, output: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """Record one training step's `(loss, logits, labels)`; reports every `log_every` steps."""
        if self._first_step is None:  # before this method's own first-call costs (the AUC's)
            self._first_step = time.perf_counter() - self._started
        loss, logits, labels = output
        self._unreported.append(loss.detach())
        self._train_auc.update(torch.sigmoid(logits.detach()), labels)
        self._step += 1
        self._bar.update(1)
        if self._step >= self._config.warmup_steps:
            # No device sync per step (it would stall the pipeline's queue on GPU): a host-side
            # period, which the device's bounds once the host waits on it.
            if self._step == self._config.warmup_steps:
                _sync(self._device)
            now = time.perf_counter()
            if self._step_end is not None:
                self.step_seconds.append(now - self._step_end - self._paused_in_step)
            self._step_end, self._paused_in_step = now, 0.0
        if self._step == self._config.warmup_steps:
            self._measure_start = self._step_end
        if len(self._unreported) == self._config.log_every:
            self._report()

    def eval_pass(self, outputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        """Record one eval pass's outputs, one per batch, and report them."""
        for _, logits, labels in outputs:
            self._eval_auc.update(torch.sigmoid(logits), labels)
        losses = [loss.item() for loss, _, _ in outputs]
        self.eval_losses.append(losses)
        mean = _global_mean(sum(losses), len(losses), self._device)
        auc = float(self._eval_auc.compute())
        self._eval_auc.reset()
        self._last.update(eval_loss=mean, eval_auc=auc)
        self.write(f"eval after step {self._step} | loss {mean:.4f} | auc {auc:.4f}")

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Leave the time spent inside (an eval pass) out of the training throughput."""
        _sync(self._device)
        started = time.perf_counter()
        yield
        _sync(self._device)
        gap = time.perf_counter() - started
        self._interval_start += gap
        self._paused_in_step += gap
        if self._measure_start is not None:
            self._paused_seconds += gap

    def finish(self) -> dict[str, Any]:
        """Report the last partial interval and return the summary, the same on every rank."""
        if self._unreported:
            self._report()
        self._bar.close()
        _sync(self._device)
        end = time.perf_counter()
        start = self._measure_start if self._measure_start is not None else self._started
        measured = self._step
        if self._measure_start is not None:
            measured -= self._config.warmup_steps
        seconds = _global_max(end - start - self._paused_seconds, self._device)
        median = _global_max(statistics.median(self.step_seconds) if self.step_seconds else 0.0, self._device)
        summary: dict[str, Any] = {
            "steps": self._step,
            "global_batch_size": self._config.batch_size,
            "train_seconds": round(_global_max(end - self._started, self._device), 3),
            "timed_steps": measured,
            "step_time_ms": round(1000 * median, 3) if self.step_seconds else None,
            "first_step_ms": round(1000 * _global_max(self._first_step or 0.0, self._device), 3),
            "samples_per_second": round(measured * self._config.batch_size / seconds, 1)
            if measured
            else None,
        }
        summary.update({k: round(v, 5) for k, v in self._last.items()})
        summary["eval_passes"] = len(self.eval_losses)
        return summary

    def close(self) -> None:
        """Close the progress bar (its line ends), e.g. before an error is printed."""
        self._bar.close()

    def _report(self) -> None:
        interval = torch.stack(self._unreported)
        steps, recent = len(self._unreported), interval.sum().item()
        self.losses += interval.tolist()
        self._unreported.clear()
        loss = _global_mean(recent, steps, self._device)
        auc = float(self._train_auc.compute())
        self._train_auc.reset()
        now = time.perf_counter()
        step_ms = 1000 * (now - self._interval_start) / steps
        rate = self._config.batch_size * 1000 / step_ms
        self._last.update(train_loss=loss, train_auc=auc)
        self._bar.set_postfix(loss=f"{loss:.4f}", auc=f"{auc:.3f}")
        self.write(
            f"step {self._step} | loss {loss:.4f} | auc {auc:.4f} | "
            f"{rate:,.0f} samples/s | {step_ms:.1f} ms/step"
        )
        self._interval_start = now

    def write(self, line: str) -> None:
        """Print `line` on rank 0 without breaking the progress bar."""
        if self._verbose:
            self._bar.write(line)


def _global_mean(total: float, count: int, device: torch.device) -> float:
    t = torch.tensor([total, float(count)], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t[0] / t[1])


def _global_max(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
