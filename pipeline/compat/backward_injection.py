"""torchrec's backward-injection API, ours: run work at a chosen point of backward.

An `InjectionSite` names a module (its FQN in the user's model) and how to find the point:
`InjectionTargetType.PARAM_GRAD` hooks one trainable parameter of the module (the work runs once its
gradient is accumulated); `InjectionTargetType.ACTIVATION` hooks, at every forward, a tensor that the
site's `GradTensorFinder` picks from the module's inputs or output. `OutputDistTensorFinder` picks
the one whose gradient arrives when the backward of a sharded module's output all-to-all runs. Names,
fields, defaults and errors are torchrec's (`torchrec.distributed.train_pipeline.backward_injection`);
torchrec's own `InjectionSite` and finders are accepted wherever ours are.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum, unique
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from torchrec.distributed.comm_ops import Request
from torchrec.distributed.types import NoWait, ShardingType
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from pipeline.stages.backward_step import will_hook_fire

if TYPE_CHECKING:
    from torchrec.distributed.train_pipeline.train_pipelines import TrainPipeline

__all__ = [
    "BackwardHookWork",
    "FirstGradTensorFinder",
    "GradTensorFinder",
    "InjectionSite",
    "InjectionTargetType",
    "OutputDistTensorFinder",
    "hook_backward",
    "register_backward_hook",
    "will_hook_fire",
]

logger = logging.getLogger(__name__)

BackwardHookWork = Callable[["TrainPipeline"], None]
"""What a pipeline's `register_backward_hook(site, work)` runs: `work(pipeline)`."""


@unique
class InjectionTargetType(Enum):
    """How `register_backward_hook` reaches its point of backward."""

    PARAM_GRAD = "param_grad"
    """A post-accumulate-grad hook on one trainable parameter of the module (`hook_position`
    picks it): runs once that parameter's gradient is accumulated. Fires for plain leaves and
    FSDP2 parameters, never for ShardedTensor parameters (fused embedding kernels)."""
    ACTIVATION = "activation"
    """A forward hook that, at every forward, asks the site's finder for a tensor and hooks its
    gradient."""


@runtime_checkable
class GradTensorFinder(Protocol):
    """Picks the tensor to hook from a module's forward: `(module_input, module_kwargs_input,
    module_output) -> tensor or None`."""

    def __call__(
        self, module_input: Any, module_kwargs_input: Any, module_output: Any
    ) -> torch.Tensor | None: ...


@dataclass(frozen=True)
class FirstGradTensorFinder:
    """The first tensor that requires grad in the module's output (with `use_input`: in its
    positional inputs, then its keyword inputs), searching tuples, lists, dicts and the weights
    of (Keyed)JaggedTensors."""

    use_input: bool = False

    def _search(self, data: Any) -> torch.Tensor | None:
        if isinstance(data, torch.Tensor):
            return data if data.requires_grad else None
        if isinstance(data, (KeyedJaggedTensor, JaggedTensor)):
            weights = data.weights_or_none()
            return weights if weights is not None and weights.requires_grad else None
        items = data.values() if isinstance(data, dict) else data if isinstance(data, (tuple, list)) else ()
        for item in items:
            found = self._search(item)
            if found is not None:
                return found
        return None

    def __call__(
        self, module_input: Any, module_kwargs_input: Any, module_output: Any
    ) -> torch.Tensor | None:
        found = self._search(module_input if self.use_input else module_output)
        if found is None and self.use_input:
            found = self._search(module_kwargs_input)
        return found


@dataclass(frozen=True)
class OutputDistTensorFinder:
    """In a sharded embedding module's output (the awaitable of its output all-to-alls), the
    all-to-all of `sharding_type`; returns the tensor whose gradient arrives when that
    all-to-all's backward runs (None when that all-to-all is not a tensor request: on one rank, or
    under torchrec's sync collectives).

    Raises (when called):
        RuntimeError: the output is not a sharded embedding module's awaitable, or has no
            all-to-all of `sharding_type` (data-parallel tables have none).
    """

    sharding_type: ShardingType = ShardingType.TABLE_WISE

    def __call__(
        self, module_input: Any, module_kwargs_input: Any, module_output: Any
    ) -> torch.Tensor | None:
        output = module_output[0] if isinstance(module_output, tuple) else module_output  # managed collision
        # EBC awaitables keep `_awaitables`, EC awaitables `_awaitables_per_sharding`, each beside
        # `_sharding_types`: torchrec's layout, read by duck typing so that every variant matches
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
    """A point of backward: the module `fqn` of the model (as the user's model names it) and how
    to reach it.

    Attributes:
        fqn: the module's fully qualified name, e.g. "sparse_arch.ebc".
        tensor_finder: picks the tensor to hook (ACTIVATION only).
        target_type: PARAM_GRAD or ACTIVATION.
        hook_position: which parameter (PARAM_GRAD only), as a fraction of the module's
            `named_parameters()`: 0.0 the first, 1.0 the last; the nearest hookable one is taken.
    """

    fqn: str
    tensor_finder: GradTensorFinder
    target_type: InjectionTargetType = InjectionTargetType.ACTIVATION
    hook_position: float = 1.0


def register_backward_hook(
    site: InjectionSite, model: nn.Module, hook_fn: Callable[[torch.Tensor], None]
) -> RemovableHandle:
    """Call `hook_fn(grad)` at `site` during every backward through `model`.

    Args:
        site: where (ours or torchrec's `InjectionSite`).
        model: the model `site.fqn` is relative to.
        hook_fn: called with the gradient (PARAM_GRAD: the parameter's accumulated gradient).

    Returns:
        The handle; `.remove()` unregisters the hook.

    Raises:
        ValueError: `site.fqn` is not a module of `model`; it has no hookable parameter
            (PARAM_GRAD); or the target type is unknown.
        RuntimeError (during forward, ACTIVATION): the finder found no tensor in the module's
            forward.
    """
    return hook_backward(site, model, hook_fn, active=None)


def hook_backward(
    site: InjectionSite,
    model: nn.Module,
    hook_fn: Callable[[torch.Tensor], None],
    *,
    active: Callable[[], bool] | None,
) -> RemovableHandle:
    """`register_backward_hook`, for a pipeline's own work: with `active`, the hook does nothing
    while `active()` is False (a forward and backward the user runs on the model directly, an
    eval forward), and an ACTIVATION site hooks nothing in a forward that records no gradient or
    where the finder finds no tensor (the site is not reached in that backward: the pipeline must
    run its work after backward then)."""
    try:
        target = model.get_submodule(site.fqn)
    except AttributeError:
        raise ValueError(f"register_backward_hook: module '{site.fqn}' not found in model.") from None
    kind = getattr(site.target_type, "value", site.target_type)  # torchrec's enum or ours
    if kind == InjectionTargetType.PARAM_GRAD.value:
        return _hook_parameter(site, target, hook_fn, active)
    if kind == InjectionTargetType.ACTIVATION.value:
        return _hook_activation(site, target, hook_fn, active)
    raise ValueError(f"register_backward_hook: unknown target_type '{site.target_type}'.")


def _hook_parameter(
    site: InjectionSite,
    target: nn.Module,
    hook_fn: Callable[[torch.Tensor], None],
    active: Callable[[], bool] | None,
) -> RemovableHandle:
    named = list(target.named_parameters())
    # the position indexes every parameter, hookable or not, so that it means the same place
    # whichever parameters are hookable; the nearest hookable one is taken
    wanted = min(int(max(0.0, min(1.0, site.hook_position)) * len(named)), len(named) - 1) if named else 0
    chosen = next((i for i in _outward(wanted, len(named)) if will_hook_fire(named[i][1])), None)
    if chosen is None:
        raise ValueError(
            f"register_backward_hook: module '{site.fqn}' has no hookable parameter "
            f"({_why_unhookable(named)}): a PARAM_GRAD site needs a leaf parameter that requires "
            "grad and is not a ShardedTensor; name a dense module, or use an ACTIVATION site"
        )
    name, param = named[chosen]
    logger.info("register_backward_hook: %s.%s (parameter %d of %d)", site.fqn, name, chosen, len(named))

    def accumulated(p: torch.Tensor) -> None:
        if active is None or active():
            hook_fn(p.grad)

    return param.register_post_accumulate_grad_hook(accumulated)


def _outward(start: int, n: int) -> Iterator[int]:
    """Indices of [0, n) by distance from `start`, the later one first on a tie."""
    if 0 <= start < n:
        yield start
    for step in range(1, n):
        for i in (start + step, start - step):
            if 0 <= i < n:
                yield i


def _why_unhookable(named: list[tuple[str, nn.Parameter]]) -> str:
    no_grad = sum(1 for _, p in named if not p.requires_grad)
    sharded = sum(1 for _, p in named if p.requires_grad and type(p).__name__ == "ShardedTensor")
    return f"{len(named)} parameters: {no_grad} without grad, {sharded} ShardedTensor"


def _hook_activation(
    site: InjectionSite,
    target: nn.Module,
    hook_fn: Callable[[torch.Tensor], None],
    active: Callable[[], bool] | None,
) -> RemovableHandle:
    def at_forward(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if active is not None and not (active() and torch.is_grad_enabled()):
            return
        tensor = site.tensor_finder(args, kwargs, output)
        if tensor is None and active is None:
            raise RuntimeError(f"register_backward_hook: no grad-requiring tensor in output of '{site.fqn}'.")
        # a pipeline's site may have nothing to hook: on one rank (or under torchrec's sync
        # collectives) the output all-to-all is no request with a gradient of its own; backward
        # does not reach the site then, and the pipeline runs its work after backward
        if tensor is not None and (active is None or tensor.requires_grad):
            tensor.register_hook(hook_fn)

    return target.register_forward_hook(at_forward, with_kwargs=True)
