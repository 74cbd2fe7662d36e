"""torch.compile pipelines: `TrainPipelinePT2` (the model compiled after its first steps) and
`TrainPipelineSparseDistCompAutograd` (SparseDist with the backward under compiled autograd).

Both run on CPU (inductor builds its kernels with the machine's C++ compiler). torchrec's dynamo
settings for torchrec models are applied only around the pipeline's own calls
(`torch._dynamo.config.patch`), not left set for the whole process as torchrec's classes leave
them. Where torchrec's classes fail on CPU, and why, is in docs/pipeline.md ("PT2").
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torchrec.distributed.comm_ops import torchrec_use_sync_collectives
from torchrec.pt2.utils import kjt_for_pt2_tracing
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from pipeline.pipelines.base import TrainPipelineBase
from pipeline.compat.signatures import Bound
from pipeline.config import CompileOptions, TorchCompileConfig
from pipeline.pipelines.sparse_dist import TrainPipelineSparseDist

__all__ = [
    "COMPILED_AUTOGRAD_DEFAULTS",
    "DYNAMO_SETTINGS",
    "CompiledForward",
    "TorchCompileConfig",
    "TrainPipelinePT2",
    "TrainPipelineSparseDistCompAutograd",
    "pt2_input_transformer",
]

DYNAMO_SETTINGS = {
    "capture_scalar_outputs": True,
    "capture_dynamic_output_shape_ops": True,
    "force_unspec_int_unbacked_size_like_on_torchrec_kjt": True,
    "skip_torchrec": False,
}
"""`torch._dynamo.config` while a torchrec model is traced (torchrec's list: KJT sizes come from
`.item()` and `.tolist()`, which must stay in the graph as unbacked symbols)."""

COMPILED_AUTOGRAD_DEFAULTS = {"backend": "inductor", "dynamic": True, "fullgraph": True}
"""torchrec's torch.compile arguments for the backward graph (fullgraph becomes False on CPU)."""

# torchrec also sets dynamo's inline_inbuilt_nn_modules (always on since torch 2.6) and
# skip_fsdp_hooks (gone from torch 2.13); the rest of its compiled-autograd settings:
_AUTOGRAD_FUNCTORCH = {"recompute_views": True, "cse": False}
_AUTOGRAD_INDUCTOR = {
    "reorder_for_compute_comm_overlap": True,
    "reorder_for_compute_comm_overlap_passes": ["sink_waits", "raise_comms", "reorder_compute_for_overlap"],
}
_MAX_DEPTH = 8


def pt2_input_transformer(batch: Any) -> Any:
    """`batch` with every KeyedJaggedTensor in it (dataclass fields, dict values, list and tuple
    items, `id_list_features`-style attributes) rebuilt by torchrec's `kjt_for_pt2_tracing`: its
    caches dropped and its values' length marked unbacked, so that a new batch with another number
    of ids does not recompile the model. torchrec's default looks at two attribute names only."""
    return _map_kjts(batch, kjt_for_pt2_tracing, 0)


def _map_kjts(value: Any, fn: Callable[[KeyedJaggedTensor], KeyedJaggedTensor], depth: int) -> Any:
    if isinstance(value, KeyedJaggedTensor):
        return fn(value)
    if depth >= _MAX_DEPTH or isinstance(value, (torch.Tensor, str, bytes, int, float)) or value is None:
        return value
    if isinstance(value, dict):
        return type(value)((k, _map_kjts(v, fn, depth + 1)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_map_kjts(v, fn, depth + 1) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = [f.name for f in dataclasses.fields(value) if f.init]
        return dataclasses.replace(value, **{n: _map_kjts(getattr(value, n), fn, depth + 1) for n in fields})
    for name in ("id_list_features", "id_score_list_features"):  # torchrec's own batch classes
        if isinstance(getattr(value, name, None), KeyedJaggedTensor):
            setattr(value, name, fn(getattr(value, name)))
    return value


class CompiledForward:
    """The forward of `TrainPipelinePT2`: the model un-compiled for `compile_on_iter` calls, then
    compiled in place (`nn.Module.compile`, as torchrec does), each batch passed through the input
    transformer first and traced under `DYNAMO_SETTINGS`."""

    def __init__(self, model: nn.Module, options: CompileOptions) -> None:
        self.model = model
        self.config: TorchCompileConfig = options.compile_configs
        self.calls = 0
        """Forward calls so far (training and eval, as torchrec counts them)."""
        self._options = options
        self._transform = options.input_transformer or pt2_input_transformer

    @property
    def compiled(self) -> bool:
        """Whether the model has been compiled (from call `compile_on_iter` on)."""
        return self.calls > self.config.compile_on_iter

    def __call__(self, batch: Any) -> Any:
        # the transformer's hints (unbacked sizes) must be on the very objects passed to the model
        batch = self._transform(batch)
        with torch._dynamo.config.patch(DYNAMO_SETTINGS):
            if self.calls == self.config.compile_on_iter:
                self._compile()
            self.calls += 1
            return self.model(batch)

    def _compile(self) -> None:
        config, options = self.config, self._options
        if options.pre_compile_fn is not None:
            options.pre_compile_fn(self.model)
        torch.ops.import_module("fbgemm_gpu.sparse_ops")  # fake kernels of fbgemm's sparse ops
        self.model.compile(fullgraph=config.fullgraph, dynamic=config.dynamic, backend=config.backend)
        if options.post_compile_fn is not None:
            options.post_compile_fn(self.model)


class TrainPipelinePT2(TrainPipelineBase):
    """`TrainPipelineBase` with the model compiled by torch.compile from step `compile_on_iter` on.

    Args (torchrec 1.8's, in its order, then ours, keyword-only; `pipeline.compat.signatures`):
        model: the model; `model(batch)` returns `(loss, output)` in training mode.
        optimizer: stepped after each training batch's backward.
        device: where batches are copied to.
        compile_configs: a `TorchCompileConfig` (ours or torchrec's); None: its defaults
            (inductor, compiled before the fourth step).
        pre_compile_fn, post_compile_fn: called with the model before and after it is compiled.
        input_transformer: applied to each batch on the device, right before forward; None:
            `pt2_input_transformer` (every KJT of the batch prepared for tracing).
        streams, on_uneven, check_keys, agreement, abort_on_error, failure_grace, peer_timeout:
            the streams and `RankOptions`.

    Unlike torchrec's class, the copy of batch i+1 overlaps the compute of batch i (Base's step);
    the numbers are the plain compiled loop's.
    """

    def _compose(self, bound: Bound) -> None:
        self._compiled = CompiledForward(bound.model, bound.options.compile)
        self._model_fwd = self._compiled

    @property
    def compiled(self) -> bool:
        """Whether the model has been compiled yet."""
        return self._compiled.compiled


class TrainPipelineSparseDistCompAutograd(TrainPipelineSparseDist):
    """`TrainPipelineSparseDist` whose backward runs under compiled autograd, and whose forward and
    backward use torchrec's synchronous collectives (which compiled autograd can trace).

    Args: torchrec 1.8's, in its order (those of `TrainPipelineSparseDist` without
    `dmp_collection_sync_interval_batches`, `enqueue_batch_after_forward` and
    `enable_inplace_copy_batch`), then ours, keyword-only: `compiled_autograd_options` (torch.compile
    arguments for the backward graph; None: the model's `_compiled_autograd_options` as in
    torchrec, else `COMPILED_AUTOGRAD_DEFAULTS`, with fullgraph=False on CPU) and those of our
    `TrainPipelineSparseDist`.

    Raises:
        ValueError: the model holds a DistributedDataParallel with its C++ reducer (the dense
            part of a DistributedModelParallel, unless `torch._dynamo.config.optimize_ddp` was
            "python_reducer" when it was built): compiled autograd cannot trace that reducer.
    """

    def _compose(self, bound: Bound) -> None:
        super()._compose(bound)
        _refuse_cpp_reducer(bound.model)
        options = _autograd_options(bound.model, bound.options.compile, self._device)
        self.compiled_autograd_options: dict[str, Any] = options
        """The torch.compile arguments of the backward graph."""
        self._step_context = _CompiledAutograd(torch.compile(**options))


class _CompiledAutograd:
    """The context of each CompAutograd step: sync collectives, compiled autograd, the settings."""

    def __init__(self, compiler: Callable[..., Any]) -> None:
        self._compiler = compiler

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with (
            torch._dynamo.config.patch(DYNAMO_SETTINGS),
            torch._functorch.config.patch(_AUTOGRAD_FUNCTORCH),
            torch._inductor.config.patch(_AUTOGRAD_INDUCTOR),
            torchrec_use_sync_collectives(),
            torch._dynamo.compiled_autograd._enable(self._compiler),
        ):
            yield


def _autograd_options(model: nn.Module, options: CompileOptions, device: torch.device) -> dict[str, Any]:
    given = options.compiled_autograd_options
    if given is None:
        given = getattr(model, "_compiled_autograd_options", None)
    if given is not None:
        return dict(given)
    # fbgemm's CPU build registers no fake kernels for its table-batched embedding ops: the
    # backward graph must break around them there, which fullgraph=True refuses
    return {**COMPILED_AUTOGRAD_DEFAULTS, "fullgraph": device.type != "cpu"}


def _refuse_cpp_reducer(model: nn.Module) -> None:
    for name, module in model.named_modules():
        if isinstance(module, nn.parallel.DistributedDataParallel) and not getattr(
            module, "_use_python_reducer", False
        ):
            raise ValueError(
                f"TrainPipelineSparseDistCompAutograd: {name or 'the model'} is a DistributedDataParallel "
                "with the C++ reducer, which compiled autograd cannot trace. Set "
                'torch._dynamo.config.optimize_ddp = "python_reducer" before building the model '
                "(DistributedModelParallel wraps its dense part in DDP when it is built)."
            )
