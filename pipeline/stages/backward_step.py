"""`StepInBackward`: the optimizer stage run inside backward (TrainPipelineSparseDistBwdOpt).

torchrec's class steps the dense optimizer from a hook at an injection site of backward (the
backward of a sharded module's output all-to-all), whatever the gradients are then: where a dense
gradient is not final at the site (a branch of the model whose backward comes later, or DDP's
all-reduce, which completes only at the end of backward) that step applies partial or unreduced
gradients. This component keeps the plain loop's numbers: the step runs at the site, or as soon as
after it every gradient it applies is final:

- without DDP (plain leaves, or FSDP2, whose reduced gradient fires the same hook), once the site
  is reached and the post-accumulate-grad hook of every parameter of the optimizer has fired;
- where DDP reduces some of those gradients, at the end of backward, after DDP's all-reduce (an
  autograd-engine callback queued behind DDP's);
- else (the site was not reached, a parameter got no gradient), after backward returns.

`placement` says which, per step.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Any

import torch
from torch import nn

__all__ = ["StepInBackward", "StepPlacement", "will_hook_fire"]


class StepPlacement(Enum):
    """Where `StepInBackward` ran the optimizer stage of a step."""

    AT_SITE = "at the injection site"
    AT_LAST_GRADIENT = "at the last dense gradient, after the injection site"
    AT_END_OF_BACKWARD = "at the end of backward, after DDP's all-reduce of the gradients"
    AFTER_BACKWARD = "after backward (the injection site was not reached, or a gradient never came)"


def will_hook_fire(p: torch.Tensor) -> bool:
    """Whether a post-accumulate-grad hook on `p` fires: a leaf that requires grad and is not a
    ShardedTensor (whose fused kernel writes its update without calling the hooks)."""
    return p.is_leaf and p.requires_grad and type(p).__name__ != "ShardedTensor"


def _reduced_by_ddp(model: nn.Module) -> set[int]:
    """Ids of the parameters whose gradients a DistributedDataParallel inside `model` all-reduces
    (final only when its reducer finishes, at the end of backward)."""
    reduced: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.parallel.DistributedDataParallel):
            ignored = getattr(module, "parameters_to_ignore", set())
            reduced |= {id(p) for n, p in module.module.named_parameters() if n not in ignored}
    return reduced


class StepInBackward:
    """Runs `step` inside backward once the injection site is reached and every gradient it
    applies is final (see the module).

    Args:
        model: the pipeline's model (its DDP wrappers say which gradients are final only at the
            end of backward).
        optimizer: the optimizer whose parameters' gradients are waited for.
        step: the optimizer stage.
    """

    def __init__(self, model: nn.Module, optimizer: Any, step: Callable[[], None]) -> None:
        self._step = step
        params = [p for group in optimizer.param_groups for p in group["params"] if will_hook_fire(p)]
        reduced = _reduced_by_ddp(model)
        self._awaited = frozenset(id(p) for p in params)
        self._at_end = any(id(p) in reduced for p in params)
        self._pending: set[int] = set()
        self._armed = False
        self._site_reached = False
        self._queued = False
        self.placement: StepPlacement | None = None
        """Where the step ran in the last step (None before the first, or while it has not run)."""
        self._handles = [p.register_post_accumulate_grad_hook(self._accumulated) for p in params]

    @property
    def armed(self) -> bool:
        """Between `arm()` and `finish()`: the hooks act (not in a user's own backward)."""
        return self._armed

    def arm(self) -> None:
        """Before a training batch's forward."""
        self._armed, self._site_reached, self._queued = True, False, False
        self._pending = set(self._awaited)
        self.placement = None

    def at_site(self) -> None:
        """The injection site's hook: backward reached it."""
        if self._armed and not self._site_reached:
            self._site_reached = True
            self._try(StepPlacement.AT_SITE)

    def finish(self) -> StepPlacement:
        """After backward: the step, if backward did not run it. Returns where it ran."""
        if self.placement is None:
            self._run(StepPlacement.AFTER_BACKWARD)
        self._armed = False
        assert self.placement is not None
        return self.placement

    def disarm(self) -> None:
        """The step ended abnormally (the pipeline reset): nothing runs until the next `arm()`."""
        self._armed = False

    def _accumulated(self, p: torch.Tensor) -> None:
        if self._armed:
            self._pending.discard(id(p))
            if self._site_reached:
                self._try(StepPlacement.AT_LAST_GRADIENT)

    def _try(self, placement: StepPlacement) -> None:
        if self.placement is not None or self._queued:
            return
        if self._at_end:
            # DDP queues its reducer's finish as an engine callback during backward, possibly
            # after this point: a callback queued by a callback runs after all of those
            self._queued = True
            engine = torch.autograd.Variable._execution_engine
            engine.queue_callback(lambda: engine.queue_callback(self._at_end_of_backward))
        elif not self._pending:
            self._run(placement)

    def _at_end_of_backward(self) -> None:
        self._run(StepPlacement.AT_END_OF_BACKWARD)

    def _run(self, placement: StepPlacement) -> None:
        if self.placement is None and self._armed:
            self.placement = placement
            self._step()
