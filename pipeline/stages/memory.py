"""What torchrec's memory flags free, as torchrec frees it (`MemoryFlags`).

- `free_features_storage_early`: a sharded module that permutes its input features keeps the
  original KeyedJaggedTensor in its context (`early_releasable_inputs`) once told to
  (`_free_features_storage_early`); after every pipelined module's input_dist has started, the
  storage of those originals is released. The batch's KeyedJaggedTensor is empty afterwards: only
  the hijacked forwards, which never read it, may see it.
- `clear_data_dist_inputs`: the tensors an input all-to-all sent are released once it completed,
  before forward, instead of when the awaitable is collected.

Both return the bytes they freed, which the pipeline adds to `InputDist.freed_bytes`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn
from torchrec.distributed.dist_data import KJTAllToAllTensorsAwaitable

__all__ = ["MemoryFlags", "free_features_early", "release_features", "release_sent_inputs"]


@dataclass(frozen=True, slots=True)
class MemoryFlags:
    """torchrec's two memory flags of the input_dist stage, as the constructors received them."""

    free_features_storage_early: bool = False
    """Free the storage of a batch's KeyedJaggedTensor once every pipelined module's input_dist
    has made its own permuted copy (torchrec's modules keep the original only while permuting)."""
    clear_data_dist_inputs: bool = False
    """Before forward of a batch, wait for its input all-to-alls and free the tensors they sent."""


def free_features_early(modules: Iterable[nn.Module]) -> Callable[[], None]:
    """Tell each sharded module that knows the flag to keep its permuted-away input for release;
    returns the undo function (for `detach()`)."""
    changed = []
    for module in modules:
        if hasattr(module, "_free_features_storage_early") and not module._free_features_storage_early:
            module._free_features_storage_early = True
            changed.append(module)

    def undo() -> None:
        for module in changed:
            module._free_features_storage_early = False

    return undo


def free_early_where_safe(rewrite: Any) -> Callable[[], None] | None:
    """`free_features_early` on `rewrite`'s modules where forward never reads the batch's features
    (every call site's input is a path in the batch); else a note in its report and None."""
    computed = [site.key for site in rewrite.sites if not site.args.is_path]
    if computed:
        rewrite.report.notes.append(
            "free_features_storage_early is off: forward computes the input of "
            f"{', '.join(computed)} from the batch's tensors, which freeing would break"
        )
        return None
    return free_features_early(pm.module for pm in rewrite.modules)


def release_features(module_contexts: Iterable[Any], narrowed: Mapping[int, Any] | None = None) -> int:
    """Free the original features the modules' contexts hold for release; returns the bytes.
    Where a module held a narrowed copy (`pipeline.stages.narrow`), `narrowed` maps its id to the
    batch's KJT, which is freed too, as it would have been without narrowing."""
    size = 0
    originals = dict(narrowed or {})
    for module_ctx in module_contexts:
        releasable = getattr(module_ctx, "early_releasable_inputs", None)
        if releasable:
            also = [originals.pop(id(kjt)) for kjt in releasable if id(kjt) in originals]
            size += sum(kjt.clear_storage() for kjt in [*releasable, *also])
            releasable.clear()
    return size


def release_sent_inputs(requests: Iterable[Any]) -> int:
    """Wait for each values all-to-all among `requests` and free what it sent; returns the bytes."""
    size = 0
    for request in requests:
        for awaitable in getattr(request, "awaitables", None) or []:
            if isinstance(awaitable, KJTAllToAllTensorsAwaitable):
                size += awaitable.clear_inputs()
    return size
