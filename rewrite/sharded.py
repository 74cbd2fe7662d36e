"""Where a model's sharded modules are: under its wrappers (`unwrap_model`), and which of them own
an input of their own (`outermost_sharded`)."""

from __future__ import annotations

from torch import nn
from torchrec.distributed.types import ShardedModule

__all__ = ["outermost_sharded", "unwrap_model"]


def unwrap_model(model: nn.Module) -> nn.Module:
    """Peel DistributedModelParallel and DDP/FSDP-style wrappers (anything with `.module`)."""
    while True:
        inner = getattr(model, "_dmp_wrapped_module", None)
        if inner is None and type(model).__name__ in ("DistributedDataParallel", "FullyShardedDataParallel"):
            inner = model.module
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def outermost_sharded(root: nn.Module) -> dict[str, ShardedModule]:
    """The sharded modules of `root` by FQN, leaving out those inside another sharded module.

    A sharded module nested in another (the EmbeddingBagCollection of a sharded
    FeatureProcessedEmbeddingBagCollection) is part of its parent's implementation: the parent calls
    it directly, never through the model's forward, so it has no input of its own to distribute.
    """
    found: dict[str, ShardedModule] = {}
    for fqn, module in root.named_modules():  # parents come before their children
        if isinstance(module, ShardedModule) and not any(fqn.startswith(f"{p}.") for p in found):
            found[fqn] = module
    return found
