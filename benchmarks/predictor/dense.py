"""The dense part of a model's step, timed on the model itself: `time_dense(model, batch)`.

Everything outside the sharded modules (the MLPs, the feature interaction, the loss, autograd's own
work) is a long tail of small operations whose cost no per-FLOP figure predicts on a CPU, so it is
measured: the model below DistributedModelParallel and DDP runs forward on the sample batch with
each sharded module replaced by a stub that returns zeros of its output's shape (no lookup, no
collective), then backward by `torch.autograd.grad` over the dense parameters. Nothing of the
model changes: no `.grad` is written, no optimizer steps, the embedding tables are not touched
(their fused update runs only in their own backward), and the buffers and the random number
generators are put back as they were, so a pipeline that predicts before its first step still
trains bit for bit as the plain loop does.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from rewrite import find_kjts, outermost_sharded, unwrap_model

__all__ = ["DenseTimes", "time_dense"]


@dataclass(frozen=True, kw_only=True, slots=True)
class DenseTimes:
    """Seconds of one step's dense work, measured on this rank."""

    forward: float
    backward: float


def time_dense(model: nn.Module, batch: Any, *, repeats: int = 5) -> DenseTimes | None:
    """Time the dense forward and backward of `model` on `batch` (module docstring); None when the
    model cannot be run that way (a sharded module whose output the stub cannot imitate, a forward
    that does not return a loss first, or any error in the stubbed forward)."""
    inner = unwrap_model(model)
    sharded = outermost_sharded(inner)
    params = [p for p in inner.parameters() if p.requires_grad and id(p) not in _ids(sharded.values())]
    device = next((p.device for p in inner.parameters()), torch.device("cpu"))
    batch = batch.to(device) if hasattr(batch, "to") and callable(batch.to) else batch
    times: list[tuple[float, float]] = []
    try:
        with _stubbed(sharded), _state_kept(inner, device):
            for _ in range(repeats + 1):
                times.append(_one(inner, batch, params, device))
    except Exception:  # an unusual model: the caller falls back to the micro-benchmarks
        return None
    if any(t is None for t in times):
        return None
    kept = times[1:]  # the first pass pays for allocations; the fastest of the rest is the cost
    return DenseTimes(forward=min(f for f, _ in kept), backward=min(b for _, b in kept))


def _one(
    inner: nn.Module, batch: Any, params: list[torch.Tensor], device: torch.device
) -> tuple[float, float] | None:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    out = inner(batch)
    loss = out[0] if isinstance(out, (tuple, list)) else out
    if not (isinstance(loss, torch.Tensor) and loss.requires_grad):
        return None
    loss = loss.sum()
    sync()
    middle = time.perf_counter()
    torch.autograd.grad(loss, params, allow_unused=True)
    sync()
    return middle - start, time.perf_counter() - middle


def _ids(modules: Any) -> set[int]:
    return {id(p) for m in modules for p in m.parameters()}


@contextlib.contextmanager
def _stubbed(sharded: dict[str, nn.Module]) -> Iterator[None]:
    """Each sharded module's forward replaced by a stub of its output (restored on exit)."""
    saved = []
    try:
        for module in sharded.values():
            saved.append((module, module.__dict__.get("forward")))
            module.forward = _stub(module)  # type: ignore[method-assign]
        yield
    finally:
        for module, previous in saved:
            if previous is None:
                del module.forward
            else:
                module.forward = previous


def _stub(module: nn.Module) -> Callable[..., Any]:
    """Zeros shaped as the module's output: a KeyedTensor of pooled embeddings, or per feature a
    JaggedTensor of one row per id. Raises TypeError for modules of another kind."""
    configs = getattr(module, "_embedding_bag_configs", None) or getattr(module, "_embedding_configs", None)
    if not configs:
        raise TypeError(f"{type(module).__name__}: no table configs to imitate its output")
    dims = {f: c.embedding_dim for c in configs for f in c.feature_names}
    keys = [f for c in configs for f in c.feature_names]
    pooled = "EmbeddingBag" in type(module).__name__

    def forward(*args: Any, **kwargs: Any) -> Any:
        kjt = next(kjt for _, kjt in find_kjts((args, kwargs)))
        device = kjt.values().device
        if pooled:
            values = torch.zeros(kjt.stride(), sum(dims[k] for k in keys), device=device, requires_grad=True)
            return KeyedTensor(keys=keys, length_per_key=[dims[k] for k in keys], values=values)
        return {k: _rows(kjt, k, dims[k], device) for k in keys if k in kjt.keys()}

    return forward


def _rows(kjt: KeyedJaggedTensor, key: str, dim: int, device: torch.device) -> JaggedTensor:
    lengths = kjt[key].lengths()
    values = torch.zeros(int(lengths.sum()), dim, device=device, requires_grad=True)
    return JaggedTensor(values=values, lengths=lengths)


@contextlib.contextmanager
def _state_kept(inner: nn.Module, device: torch.device) -> Iterator[None]:
    """Buffers (batch-norm statistics) and random generators put back on exit."""
    buffers = [(b, b.detach().clone()) for b in inner.buffers()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, copy in buffers:
                buffer.copy_(copy)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)
