"""torchrec's backward-injection API (its names, fields, defaults and errors; its own sites and finders
are accepted too): run work at the point of backward an `InjectionSite` names."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, unique
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from torchrec.distributed.comm_ops import Request
from torchrec.distributed.types import NoWait, ShardingType
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from pipeline.compat import TrainPipeline

__all__ = ["BackwardHookWork", "FirstGradTensorFinder", "GradTensorFinder", "InjectionSite"]
__all__ += ["InjectionTargetType", "OutputDistTensorFinder", "hook_backward", "register_backward_hook"]
__all__ += ["will_hook_fire"]

logger = logging.getLogger(__name__)

BackwardHookWork = Callable[[TrainPipeline], None]
"""What a pipeline's `register_backward_hook(site, work)` runs: `work(pipeline)`."""
_GradHook = Callable[[torch.Tensor], None]


@unique
class InjectionTargetType(Enum):
    """PARAM_GRAD: a post-accumulate-grad hook on one of the module's trainable parameters (never a
    ShardedTensor). ACTIVATION: a gradient hook on the tensor the site's finder picks at each forward."""

    PARAM_GRAD = "param_grad"
    ACTIVATION = "activation"


@runtime_checkable
class GradTensorFinder(Protocol):
    """`(module_input, module_kwargs_input, module_output) -> the tensor to hook, or None`."""

    def __call__(
        self, module_input: Any, module_kwargs_input: Any, module_output: Any
    ) -> torch.Tensor | None: ...


@dataclass(frozen=True)
class FirstGradTensorFinder:
    """The first tensor requiring grad in the module's output (`use_input`: its positional, then
    keyword inputs), searching tuples, lists, dicts and (Keyed)JaggedTensor weights."""

    use_input: bool = False

    def _search(self, data: Any) -> torch.Tensor | None:
        if isinstance(data, torch.Tensor):
            return data if data.requires_grad else None
        if isinstance(data, (KeyedJaggedTensor, JaggedTensor)):
            weights = data.weights_or_none()
            return weights if weights is not None and weights.requires_grad else None
        items = data.values() if isinstance(data, dict) else data if isinstance(data, (tuple, list)) else ()
        return next((found for found in map(self._search, items) if found is not None), None)

    def __call__(
        self, module_input: Any, module_kwargs_input: Any, module_output: Any
    ) -> torch.Tensor | None:
        found = self._search(module_input if self.use_input else module_output)
        return self._search(module_kwargs_input) if found is None and self.use_input else found


@dataclass(frozen=True)
class OutputDistTensorFinder:
    """The tensor whose gradient arrives when the backward of a sharded embedding module's output
    all-to-all of `sharding_type` runs; None where that all-to-all is no tensor request (one rank, or
    torchrec's sync collectives). Raises RuntimeError if the output has no such all-to-all."""

    sharding_type: ShardingType = ShardingType.TABLE_WISE

    def __call__(
        self, module_input: Any, module_kwargs_input: Any, module_output: Any
    ) -> torch.Tensor | None:
        output = module_output[0] if isinstance(module_output, tuple) else module_output  # managed collision
        # torchrec's private layout, duck-typed (EBC's `_awaitables`, EC's `_awaitables_per_sharding`)
        awaitables = getattr(output, "_awaitables", None)
        if awaitables is None:
            awaitables = getattr(output, "_awaitables_per_sharding", None)
        sharding_types = getattr(output, "_sharding_types", None)
        if awaitables is None or sharding_types is None:
            raise RuntimeError(f"Unsupported awaitable type: {type(output).__name__}")
        for awaitable, sharding_type in zip(awaitables, sharding_types, strict=False):
            if isinstance(awaitable, NoWait) or ShardingType(sharding_type) != self.sharding_type:
                continue  # data-parallel tables have no all-to-all
            request = getattr(awaitable, "_tensor_awaitable", None)
            return request.dummy_tensor if isinstance(request, Request) else None
        raise RuntimeError(f"Could not find awaitable for sharding type: {self.sharding_type}")


@dataclass(frozen=True)
class InjectionSite:
    """A point of backward.

    Attributes:
        fqn: the module's fully qualified name in the user's model, e.g. "sparse_arch.ebc".
        tensor_finder: picks the tensor to hook (ACTIVATION only).
        hook_position: PARAM_GRAD only: 0.0 the first parameter, 1.0 the last (the nearest hookable).
    """

    fqn: str
    tensor_finder: GradTensorFinder
    target_type: InjectionTargetType = InjectionTargetType.ACTIVATION
    hook_position: float = 1.0


def register_backward_hook(site: InjectionSite, model: nn.Module, hook_fn: _GradHook) -> RemovableHandle:
    """Call `hook_fn(grad)` at `site` during every backward through `model`.

    Returns:
        The handle; `.remove()` unregisters the hook.

    Raises:
        ValueError: `site.fqn` is no module, or has no hookable parameter (PARAM_GRAD); unknown type.
        RuntimeError: during forward (ACTIVATION), the finder found no tensor.
    """
    return hook_backward(site, model, hook_fn, active=None)


def hook_backward(
    site: InjectionSite, model: nn.Module, hook_fn: _GradHook, *, active: Callable[[], bool] | None
) -> RemovableHandle:
    """`register_backward_hook` for a pipeline's own work: the hook acts only while `active()`, and an
    ACTIVATION site without a tensor to hook (no grad, one rank, sync collectives) hooks nothing: the
    pipeline then runs its work after backward."""
    try:
        target = model.get_submodule(site.fqn)
    except AttributeError:
        raise ValueError(f"register_backward_hook: module '{site.fqn}' not found in model.") from None
    kind = getattr(site.target_type, "value", site.target_type)  # torchrec's enum or ours
    if kind == InjectionTargetType.PARAM_GRAD.value:
        named = list(target.named_parameters())
        # counts all parameters, hookable or not, to name one place; the nearest hookable, later on a tie
        wanted = min(int(max(0.0, min(1.0, site.hook_position)) * len(named)), len(named) - 1) if named else 0
        nearest = sorted(range(len(named)), key=lambda i: (abs(i - wanted), -i))
        chosen = next((i for i in nearest if will_hook_fire(named[i][1])), None)
        if chosen is None:
            no_grad = sum(1 for _, p in named if not p.requires_grad)
            sharded = sum(1 for _, p in named if p.requires_grad and type(p).__name__ == "ShardedTensor")
            raise ValueError(
                f"register_backward_hook: module '{site.fqn}' has no hookable parameter "
                f"({len(named)} parameters: {no_grad} without grad, {sharded} ShardedTensor): a PARAM_GRAD "
                "site needs a leaf parameter that requires grad and is not a ShardedTensor; name a dense "
                "module, or use an ACTIVATION site"
            )
        name, param = named[chosen]
        logger.info("register_backward_hook: %s.%s (parameter %d of %d)", site.fqn, name, chosen, len(named))

        def accumulated(p: torch.Tensor) -> None:
            if active is None or active():
                hook_fn(p.grad)

        return param.register_post_accumulate_grad_hook(accumulated)
    if kind != InjectionTargetType.ACTIVATION.value:
        raise ValueError(f"register_backward_hook: unknown target_type '{site.target_type}'.")

    def at_forward(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if active is not None and not (active() and torch.is_grad_enabled()):
            return
        tensor = site.tensor_finder(args, kwargs, output)
        if tensor is None and active is None:
            raise RuntimeError(f"register_backward_hook: no grad-requiring tensor in output of '{site.fqn}'.")
        if tensor is not None and (active is None or tensor.requires_grad):
            tensor.register_hook(hook_fn)

    return target.register_forward_hook(at_forward, with_kwargs=True)


def will_hook_fire(p: torch.Tensor) -> bool:
    """Whether a post-accumulate-grad hook on `p` fires (a ShardedTensor's fused kernel skips hooks)."""
    return p.is_leaf and p.requires_grad and type(p).__name__ != "ShardedTensor"
