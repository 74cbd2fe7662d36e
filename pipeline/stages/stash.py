"""`Stash`: device memory lent out between two uses (torchrec's memory stashing, ours).

`stash(tensors)` copies the storage of each tensor to host memory and frees it (its size becomes
0); `restore()` allocates each storage again and copies it back. The tensors keep their identity,
shape and views (an optimizer's state, a kernel's weights), so whoever holds them sees the same
values once restored; a tensor must not be read while stashed. Storages are copied whole and
once, however many of the tensors view them.

On CUDA the copies run on the memcpy stream (host memory pinned): the stash after the producer's
work on the caller's stream, the restore after the caller's stream too; `ready()` orders the
caller's stream after the restore, and the freed block is kept from reuse until its copy is done
(`Streams.free_after`). On CPU the host copy is in the same memory: nothing is
saved, and the stash runs for its semantics (which tests check on CPU).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.stages.streams import Streams, label

__all__ = ["Stash", "tensors_in"]


@dataclass(slots=True)
class _Lent:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.UntypedStorage
    device: torch.device
    restored: bool = False


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in `value`: tensors, DTensors (their local part), and those in tuples, lists,
    dicts, dataclasses and plain objects' attributes (an optimizer's state). A ShardedTensor's are
    left out: a fused kernel updates them inside backward."""
    if type(value).__name__ == "ShardedTensor":
        return []
    if isinstance(value, torch.Tensor):
        local = value.to_local() if hasattr(value, "to_local") else value
        return [local]
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
    """Storages lent to host memory, and given back.

    Args:
        streams: the pipeline's streams (the copies run on `memcpy`).
        name: for the profiler labels (`pipeline::stash::<name>`, `pipeline::restore::<name>`).
    """

    def __init__(self, streams: Streams, name: str) -> None:
        self._streams, self._name = streams, name
        self._lent: list[_Lent] = []

    @property
    def lent_bytes(self) -> int:
        """Bytes of device memory lent out now (freed, not yet restored)."""
        return sum(lent.nbytes for lent in self._lent if not lent.restored)

    def stash(self, tensors: Iterable[torch.Tensor]) -> None:
        """Copy the storages of `tensors` to host memory and free them; a storage lent already
        (or empty) is skipped. Several stashes may be lent at once; `restore()` gives all back."""
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
                host = _host_buffer(storage)
                host.copy_(storage, non_blocking=host.is_pinned())
                added.append(_Lent(storage, storage.nbytes(), host, tensor.device))
            for lent in added:
                if streams.memcpy is not None:  # the block is not reused before its copy is done
                    streams.free_after(_view(lent.storage, lent.device), streams.memcpy)
                _resize(lent.storage, 0)
        self._lent += added

    def restore(self) -> None:
        """Allocate every lent storage again and copy it back (a no-op when nothing is lent).
        `ready()` must follow before the caller's stream reads them."""
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


def _host_buffer(storage: torch.UntypedStorage) -> torch.UntypedStorage:
    pin = storage.device.type == "cuda"
    return torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin).untyped_storage()


def _view(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def _resize(storage: torch.UntypedStorage, nbytes: int) -> None:
    try:
        storage.resize_(nbytes)
    except RuntimeError as e:
        raise RuntimeError(
            f"cannot stash a tensor whose storage is not resizable (made outside torch's allocator, "
            f"e.g. from numpy): {e}; leave it out of the stash"
        ) from e
