"""The tiered kernel's fused optimizer: the update rule applied to rows in their cache slots during
backward (`UpdateRule`), and the `FusedOptimizer` torchrec sees (`TieredOptimizer`), whose state lives
in the stores.

Split from `tiered.kernel` along the seam between the lookup (slots, layouts, pooling) and what an
optimizer is to torchrec (fused params in, state_dict out); neither half needs the other's internals.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec.optim.fused import FusedOptimizer

from tiered.cache import RowCache

__all__ = ["TieredOptimizer", "UpdateRule"]

_STATE_WIDTH = {EmbOptimType.EXACT_SGD: 0, EmbOptimType.EXACT_ROWWISE_ADAGRAD: 1}
_ALIASES = {
    EmbOptimType.SGD: EmbOptimType.EXACT_SGD,
    EmbOptimType.ROWWISE_ADAGRAD: EmbOptimType.EXACT_ROWWISE_ADAGRAD,
}


@dataclass(kw_only=True, slots=True, frozen=True)
class UpdateRule:
    """The fused optimizer of a kernel, read from torchrec's fused params: SGD or row-wise Adagrad."""

    kind: EmbOptimType
    lr: float
    eps: float

    @classmethod
    def from_fused_params(cls, params: dict[str, Any] | None) -> UpdateRule:
        """The rule torchrec's fused params ask for.

        Raises:
            ValueError: another optimizer, or weight decay.
        """
        params = params or {}
        kind = params.get("optimizer", EmbOptimType.EXACT_SGD)
        kind = _ALIASES.get(kind, kind)
        if kind not in _STATE_WIDTH:
            raise ValueError(
                f"the tiered kernel supports SGD and row-wise Adagrad as fused optimizers; got {kind}. "
                "Use torch.optim.SGD or torchrec.optim.RowWiseAdagrad with apply_optimizer_in_backward."
            )
        if params.get("weight_decay", 0.0):
            raise ValueError("the tiered kernel does not support weight_decay; leave it 0")
        return cls(kind=kind, lr=float(params.get("learning_rate", 0.01)), eps=float(params.get("eps", 1e-8)))

    @property
    def state_width(self) -> int:
        """Optimizer-state floats per row (0 for SGD, 1 for row-wise Adagrad)."""
        return _STATE_WIDTH[self.kind]

    def apply(self, weights: torch.Tensor, state: torch.Tensor, grad: torch.Tensor) -> None:
        """Update rows `weights`/`state` (gathered copies, written back by the caller) in place."""
        if self.kind == EmbOptimType.EXACT_ROWWISE_ADAGRAD:
            state += grad.square().mean(dim=1, keepdim=True)
            weights -= grad * (self.lr / (state.sqrt() + self.eps))
        else:
            weights -= self.lr * grad


class TieredOptimizer(FusedOptimizer):
    """A tiered kernel's fused optimizer: its state (row-wise Adagrad's accumulator) lives in the
    stores; `state_dict()` flushes the caches first, `load_state_dict()` writes the stores and
    drops the caches. `step()` does nothing: the update ran in backward.

    Args:
        params: the tables' parameters by `<table>.weight` (mapped onto the stores).
        caches: one per table, in the order of `params`.
        rule: the update rule.
        flush: writes every dirty cached row back to the stores.
        purge: drops every cached row (the stores were overwritten).
    """

    def __init__(
        self,
        params: dict[str, nn.Parameter],
        caches: list[RowCache],
        rule: UpdateRule,
        *,
        flush: Callable[[], None],
        purge: Callable[[], None],
    ) -> None:
        self._flush, self._purge = flush, purge
        state: dict[Any, Any] = {}
        if rule.state_width:
            state = {p: {"momentum1": c.store.state()} for p, c in zip(params.values(), caches, strict=True)}
        group = {"params": list(params.values()), "lr": rule.lr}
        super().__init__(params, state, [group])

    def step(self, closure: Any = None) -> None:
        pass

    def zero_grad(self, set_to_none: bool = False) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        self._flush()
        return super().state_dict()

    def load_state_dict(self, state_dict: Any) -> None:
        self._flush()
        super().load_state_dict(state_dict)
        self._purge()
