"""torchrec's subclass points shared by every pipeline class: the protected methods, with torchrec's
names and signatures, that a user's subclass overrides and every class's step calls (`_next_batch`
for every batch fetched, `_backward`, `_optimizer_step`; `_wait_for_batch`, with torchrec's two
signatures, each class defines). docs/reference.md, "Subclassing", says what an override must do.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["SubclassPoints"]


class SubclassPoints:
    """The default `_next_batch`, `_backward` and `_optimizer_step` (torchrec's behaviour)."""

    _optimizer: Any

    def _next_batch(self, dataloader_iter: Iterator[Any]) -> Any | None:
        """The next batch of `dataloader_iter`, or None once it has ended.

        Every batch the pipeline fetches comes from here. An override may skip batches (call
        `super()._next_batch` again) or transform them; it must return None at the end, and only
        there (None ends this rank's data; the ranks then agree on where the data ended).
        """
        return next(dataloader_iter, None)

    def _backward(self, losses: torch.Tensor) -> None:
        """Backward of the loss of the batch at the head (`losses`: what the model returned).

        An override may scale or add to the loss; it must run backward once, since the optimizer
        steps on the gradients it leaves.
        """
        # a scalar loss needs no sum (one kernel launch less), and the gradient is the same
        loss = losses if isinstance(losses, torch.Tensor) and losses.dim() == 0 else torch.sum(losses)
        loss.backward()

    def _optimizer_step(self) -> None:
        """Step the optimizer after backward. An override may clip gradients first, skip a step
        or step a learning-rate scheduler too."""
        self._optimizer.step()
