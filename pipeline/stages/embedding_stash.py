"""`EmbeddingStash`: embedding weights lent out of device memory between their lookup in forward
and their kernel's backward (TrainPipelineSparseDistEmbStash, TrainPipelinePrefetchEMS).

Which weights: those of every embedding kernel (a group of tables) with a table marked
`stash_weights=True` in its config (torchrec's per-table flag), in every sharded module of the
model: the kernel's weights in the pipeline's device memory (`weights_dev` on CUDA, the host
weights of a CPU kernel). When: right after the kernel's lookup in forward (or, with `delay`,
when `run_pending()` is called: torchrec's delayed stash). Back: `restore()` (the pipeline calls
it from its injection site in backward), and in any case before backward reaches the kernel, from
a hook on the lookup's output: a kernel never runs backward on lent weights, whatever the site.
Eval forwards and forwards outside the pipeline's steps stash nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from pipeline.stages.stash import Stash
from pipeline.stages.streams import Streams

__all__ = ["EmbeddingStash"]


def _marked_weights(lookup: nn.Module, device: torch.device) -> list[torch.Tensor]:
    """The weights in `device` memory of `lookup`'s kernels that hold a table marked for stashing."""
    weights = []
    for kernel in getattr(lookup, "_emb_modules", ()):
        config = getattr(kernel, "_config", None)
        tables = getattr(config, "embedding_tables", ())
        inner = getattr(kernel, "_emb_module", None)
        if inner is None or not any(getattr(t, "stash_weights", False) for t in tables):
            continue
        for name in ("weights_dev", "weights_host"):
            tensor = getattr(inner, name, None)
            if isinstance(tensor, torch.Tensor) and tensor.numel() > 0 and tensor.device == device:
                weights.append(tensor)
    return weights


def _lookups(model: nn.Module) -> Iterator[nn.Module]:
    """The lookup modules of every sharded embedding module of `model` (data-parallel ones,
    wrapped in DDP, have no kernel weights to lend and are not among them)."""
    for module in model.modules():
        for lookup in getattr(module, "_lookups", None) or ():
            if hasattr(lookup, "_emb_modules"):
                yield lookup


class EmbeddingStash:
    """Lends the marked embedding weights out between lookup and backward (see the module).

    Args:
        streams: the pipeline's streams.
        model: the model whose sharded modules' lookups are watched.
        device: the pipeline's device (whose memory is freed).
        delay: keep each stash pending until `run_pending()` (torchrec's `delay_stash`).
    """

    def __init__(self, streams: Streams, model: nn.Module, device: torch.device, *, delay: bool) -> None:
        self._stash = Stash(streams, "embeddings")
        self._device, self._delay = device, delay
        self._pending: list[list[torch.Tensor]] = []
        self.armed = False
        """The pipeline's training step is between forward and the end of backward."""
        self.tables = 0
        """How many kernels (groups of tables) are marked for stashing."""
        for lookup in _lookups(model):
            if _marked_weights(lookup, device):
                self.tables += 1
                lookup.register_forward_hook(self._after_lookup)

    @property
    def lent_bytes(self) -> int:
        """Bytes of embedding weights out of device memory now."""
        return self._stash.lent_bytes

    def _after_lookup(self, lookup: nn.Module, args: Any, output: Any) -> None:
        if not (self.armed and isinstance(output, torch.Tensor) and output.requires_grad):
            return  # no backward will come to restore them
        weights = _marked_weights(lookup, self._device)
        if self._delay:
            self._pending.append(weights)
        else:
            self._stash.stash(weights)
        output.register_hook(self._before_kernel_backward)

    def _before_kernel_backward(self, grad: torch.Tensor) -> None:
        self._stash.ready()

    def run_pending(self) -> None:
        """Stash what `delay` kept pending (a no-op outside a training step)."""
        if self.armed:
            pending, self._pending = self._pending, []
            for weights in pending:
                self._stash.stash(weights)

    def restore(self) -> None:
        """Start giving back every lent weight (on CUDA the copies run on the memcpy stream; the
        kernels' backward waits for them)."""
        self._stash.restore()

    def ready(self) -> None:
        """Every lent weight back, and the caller's stream ordered after the copies."""
        self._stash.ready()

    def arm(self) -> None:
        """Before a training batch's forward."""
        self.armed = True

    def finish(self) -> None:
        """After backward (or an abnormal end of the step): everything back, nothing pending."""
        self.armed = False
        self._pending = []
        self._stash.ready()
