"""Device memory lent to host memory between two uses (torchrec's memory stashing): `Stash` frees
storages once copied to the host and gives them back, the tensors keeping their identity, shape and
views (not to be read meanwhile); `EmbeddingStash` lends marked embedding weights from lookup to backward."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipeline.stages.streams import Streams, label

__all__ = ["EmbeddingStash", "Stash", "tensors_in"]


@dataclass(slots=True)
class _Lent:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.UntypedStorage
    restored: bool = False


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in `value`, searched through containers, dataclasses and objects' attributes (an
    optimizer's state); a DTensor's local part; none of a ShardedTensor's (updated inside backward)."""
    if type(value).__name__ == "ShardedTensor":
        return []
    if isinstance(value, torch.Tensor):
        return [value.to_local() if hasattr(value, "to_local") else value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    fields = getattr(value, "__dataclass_fields__", None)
    if fields is not None:
        return [t for name in fields for t in tensors_in(getattr(value, name, None))]
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return [t for v in vars(value).values() for t in tensors_in(v)]
    return []


class Stash:
    """Storages lent to host memory, and given back; each copied whole and once, on `streams.memcpy`
    (`name` labels the profiler's `pipeline::stash::<name>` and `pipeline::restore::<name>`)."""

    def __init__(self, streams: Streams, name: str) -> None:
        self._streams, self._name = streams, name
        self._lent: list[_Lent] = []

    @property
    def lent_bytes(self) -> int:
        """Bytes of device memory lent out now (freed, not yet restored)."""
        return sum(lent.nbytes for lent in self._lent if not lent.restored)

    def stash(self, tensors: Iterable[torch.Tensor]) -> None:
        """Copy the storages of `tensors` to host memory and free them (skipping empty ones and those
        lent already); several stashes may be lent at once."""
        streams, seen = self._streams, set()
        caller = streams.current()
        added: list[_Lent] = []
        with label(f"pipeline::stash::{self._name}"), streams.use(streams.memcpy):
            streams.handoff(None, caller)  # after the work that produced them
            for tensor in tensors:
                storage = tensor.untyped_storage()
                if storage.nbytes() == 0 or storage.data_ptr() in seen:
                    continue
                seen.add(storage.data_ptr())
                pin = storage.device.type == "cuda"
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin).untyped_storage()
                host.copy_(storage, non_blocking=host.is_pinned())
                added.append(_Lent(storage, storage.nbytes(), host))
            for lent in added:
                if streams.memcpy is not None:  # the block is not reused before its copy is done
                    view = torch.empty(0, dtype=torch.uint8, device=lent.storage.device).set_(lent.storage)
                    streams.free_after(view, streams.memcpy)
                _resize(lent.storage, 0)
        self._lent += added

    def restore(self) -> None:
        """Allocate every lent storage again and copy it back; `ready()` before the caller reads them."""
        lent = [entry for entry in self._lent if not entry.restored]
        if not lent:
            return
        streams = self._streams
        caller = streams.current()
        with label(f"pipeline::restore::{self._name}"):
            for entry in lent:
                _resize(entry.storage, entry.nbytes)  # allocated on the caller's stream
            with streams.use(streams.memcpy):
                streams.handoff(None, caller)
                for entry in lent:
                    entry.storage.copy_(entry.host, non_blocking=entry.host.is_pinned())
                    entry.restored = True

    def ready(self) -> None:
        """Restore what is lent, and order the caller's stream after the restore's copies."""
        self.restore()
        if self._lent:
            self._streams.handoff(None, self._streams.memcpy)
            self._lent = []


def _resize(storage: torch.UntypedStorage, nbytes: int) -> None:
    try:
        storage.resize_(nbytes)
    except RuntimeError as e:
        raise RuntimeError(
            f"cannot stash a tensor whose storage is not resizable (made outside torch's allocator, "
            f"e.g. from numpy): {e}; leave it out of the stash"
        ) from e


def _marked_weights(lookup: nn.Module, device: torch.device) -> list[torch.Tensor]:
    """The weights on `device` of `lookup`'s kernels that hold a table marked for stashing."""
    weights = []
    for kernel in getattr(lookup, "_emb_modules", ()):
        config = getattr(kernel, "_config", None)
        tables = getattr(config, "embedding_tables", ())
        inner = getattr(kernel, "_emb_module", None)
        if inner is None or not any(getattr(t, "stash_weights", False) for t in tables):
            continue
        for name in ("weights_dev", "weights_host"):
            tensor = getattr(inner, name, None)
            if isinstance(tensor, torch.Tensor) and tensor.numel() > 0 and _on(tensor, device):
                weights.append(tensor)
    return weights


def _on(tensor: torch.Tensor, device: torch.device) -> bool:
    """`tensor` is on `device`; `cuda` without an index is the current device (which `==` denies)."""
    if tensor.device.type != device.type:
        return False
    if device.index is None:
        return device.type != "cuda" or tensor.device.index == torch.cuda.current_device()
    return tensor.device.index == device.index


class EmbeddingStash:
    """Lends the marked embedding weights on `device` (`weights_dev` on CUDA, a CPU kernel's host
    weights) from each lookup in a training step (with `delay`, from `run_pending()`) until `restore()`
    or, at the latest, the backward of the lookup's output."""

    def __init__(self, streams: Streams, model: nn.Module, device: torch.device, *, delay: bool) -> None:
        self._stash = Stash(streams, "embeddings")
        self._device, self._delay = device, delay
        self._pending: list[list[torch.Tensor]] = []
        self.armed = False  # the training step is between forward and the end of backward
        self.tables = 0  # how many kernels (groups of tables) are marked for stashing
        for module in model.modules():  # the sharded embedding modules' lookups with kernel weights
            for lookup in getattr(module, "_lookups", None) or ():
                if hasattr(lookup, "_emb_modules") and _marked_weights(lookup, device):
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
        """Start giving back every lent weight (the kernels' backward waits for the copies)."""
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
