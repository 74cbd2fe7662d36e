"""The PT2 pipelines, `TrainPipelinePT2` and `TrainPipelineSparseDistCompAutograd`; torchrec's dynamo
settings are patched around the pipeline's own calls only, not left set for the process."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torchrec.distributed.comm_ops import torchrec_use_sync_collectives
from torchrec.pt2.utils import kjt_for_pt2_tracing
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from pipeline.options import InputDistOptions, RankOptions, RewriteOptions, TorchCompileConfig
from pipeline.pipelines.base import TrainPipelineBase
from pipeline.pipelines.sparse_dist import TrainPipelineSparseDist
from pipeline.stages.streams import Streams

__all__ = ["COMPILED_AUTOGRAD_DEFAULTS", "DYNAMO_SETTINGS", "CompiledForward", "TorchCompileConfig"]
__all__ += ["TrainPipelinePT2", "TrainPipelineSparseDistCompAutograd", "compile_config"]
__all__ += ["pt2_input_transformer"]

DYNAMO_SETTINGS = {
    "capture_scalar_outputs": True,
    "capture_dynamic_output_shape_ops": True,
    "force_unspec_int_unbacked_size_like_on_torchrec_kjt": True,
    "skip_torchrec": False,
}
"""`torch._dynamo.config` while a torchrec model is traced (torchrec's: KJT sizes must stay unbacked)."""

_MAX_DEPTH = 8


def pt2_input_transformer(batch: Any) -> Any:
    """`batch` with every KeyedJaggedTensor in it (fields, dicts, lists, tuples) rebuilt by torchrec's
    `kjt_for_pt2_tracing`, so that a batch with another number of ids does not recompile the model."""
    return _map_kjts(batch, 0)


def _map_kjts(value: Any, depth: int) -> Any:
    if isinstance(value, KeyedJaggedTensor):
        return kjt_for_pt2_tracing(value)
    if depth >= _MAX_DEPTH or isinstance(value, (torch.Tensor, str, bytes, int, float)) or value is None:
        return value
    if isinstance(value, dict):
        return type(value)((k, _map_kjts(v, depth + 1)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_map_kjts(v, depth + 1) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = [f.name for f in dataclasses.fields(value) if f.init]
        return dataclasses.replace(value, **{n: _map_kjts(getattr(value, n), depth + 1) for n in fields})
    for name in ("id_list_features", "id_score_list_features"):  # torchrec's own batch classes
        if isinstance(getattr(value, name, None), KeyedJaggedTensor):
            setattr(value, name, kjt_for_pt2_tracing(getattr(value, name)))
    return value


def compile_config(given: Any) -> TorchCompileConfig:
    """`given` as our `TorchCompileConfig` (torchrec's is read field by field); None: the defaults."""
    if given is None:
        return TorchCompileConfig()
    if isinstance(given, TorchCompileConfig):
        return given
    fields = ("fullgraph", "dynamic", "backend", "compile_on_iter")
    return TorchCompileConfig(**{f: getattr(given, f) for f in fields})


class CompiledForward:
    """The forward of `TrainPipelinePT2`: the model, compiled in place (`nn.Module.compile`) at call
    `compile_on_iter`, on each batch passed through the input transformer, under `DYNAMO_SETTINGS`."""

    def __init__(
        self,
        model: nn.Module,
        config: TorchCompileConfig,
        *,
        pre_compile_fn: Callable[[nn.Module], None] | None = None,
        post_compile_fn: Callable[[nn.Module], None] | None = None,
        input_transformer: Callable[[Any], Any] | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.calls = 0  # training and eval, as torchrec counts them
        self._pre, self._post = pre_compile_fn, post_compile_fn
        self._transform = input_transformer or pt2_input_transformer

    @property
    def compiled(self) -> bool:
        """Whether the model has been compiled."""
        return self.calls > self.config.compile_on_iter

    def __call__(self, batch: Any) -> Any:
        # the transformer's hints (unbacked sizes) must be on the very objects passed to the model
        batch = self._transform(batch)
        config = self.config
        with torch._dynamo.config.patch(DYNAMO_SETTINGS):
            if self.calls == config.compile_on_iter:
                if self._pre is not None:
                    self._pre(self.model)
                torch.ops.import_module("fbgemm_gpu.sparse_ops")  # fake kernels of fbgemm's sparse ops
                self.model.compile(fullgraph=config.fullgraph, dynamic=config.dynamic, backend=config.backend)
                if self._post is not None:
                    self._post(self.model)
            self.calls += 1
            return self.model(batch)


class TrainPipelinePT2(TrainPipelineBase):
    """`TrainPipelineBase` with the model compiled by torch.compile from step `compile_on_iter` on.

    Args:
        model, optimizer, device: as in `TrainPipelineBase`.
        compile_configs: a `TorchCompileConfig` (ours or torchrec's); None: its defaults.
        pre_compile_fn, post_compile_fn: called with the model before and after it is compiled.
        input_transformer: applied to each batch on the device before forward (`pt2_input_transformer`).
        streams, ranks: keyword-only, ours, as in `TrainPipelineBase`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        compile_configs: TorchCompileConfig | None = None,
        pre_compile_fn: Callable[[torch.nn.Module], None] | None = None,
        post_compile_fn: Callable[[torch.nn.Module], None] | None = None,
        input_transformer: Callable[[Any], Any] | None = None,
        *,
        streams: Streams | None = None,
        ranks: RankOptions | None = None,
    ) -> None:
        self._compiled = CompiledForward(
            model,
            compile_config(compile_configs),
            pre_compile_fn=pre_compile_fn,
            post_compile_fn=post_compile_fn,
            input_transformer=input_transformer,
        )
        super().__init__(model, optimizer, device, self._compiled, streams=streams, ranks=ranks)

    @property
    def compiled(self) -> bool:
        """Whether the model has been compiled yet."""
        return self._compiled.compiled


COMPILED_AUTOGRAD_DEFAULTS = {"backend": "inductor", "dynamic": True, "fullgraph": True}
"""torchrec's torch.compile arguments for the backward graph (fullgraph becomes False on CPU)."""

# torchrec's compiled-autograd settings, less dynamo's inline_inbuilt_nn_modules (always on since
# torch 2.6) and skip_fsdp_hooks (gone from torch 2.13)
_AUTOGRAD_FUNCTORCH = {"recompute_views": True, "cse": False}
_AUTOGRAD_INDUCTOR = {
    "reorder_for_compute_comm_overlap": True,
    "reorder_for_compute_comm_overlap_passes": ["sink_waits", "raise_comms", "reorder_compute_for_overlap"],
}


class TrainPipelineSparseDistCompAutograd(TrainPipelineSparseDist):
    """`TrainPipelineSparseDist` whose backward runs under compiled autograd, forward and backward on
    torchrec's synchronous collectives (which compiled autograd can trace).

    Args:
        model, optimizer, device, ...: as in `TrainPipelineSparseDist` (torchrec's, in its order).
        compiled_autograd_options: keyword-only, ours: torch.compile arguments for the backward graph;
            None: the model's `_compiled_autograd_options`, else `COMPILED_AUTOGRAD_DEFAULTS`.

    Raises:
        ValueError: the model holds a DistributedDataParallel with the C++ reducer (build it under
            `torch._dynamo.config.optimize_ddp = "python_reducer"`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        context_type: Any = None,
        pipeline_postproc: bool = False,
        custom_model_fwd: Callable[[Any], tuple[torch.Tensor, Any]] | None = None,
        free_features_storage_early: bool = False,
        clear_data_dist_inputs: bool = False,
        *,
        compiled_autograd_options: dict[str, Any] | None = None,
        strict: bool = False,
        rewrite: RewriteOptions | None = None,
        input_dist: InputDistOptions | None = None,
        ranks: RankOptions | None = None,
        streams: Streams | None = None,
    ) -> None:
        _refuse_cpp_reducer(model)
        self._setup(
            model,
            optimizer,
            device,
            execute_all_batches=execute_all_batches,
            apply_jit=apply_jit,
            pipeline_postproc=pipeline_postproc,
            custom_model_fwd=custom_model_fwd,
            free_features_storage_early=free_features_storage_early,
            clear_data_dist_inputs=clear_data_dist_inputs,
            strict=strict,
            rewrite=rewrite,
            input_dist=input_dist,
            ranks=ranks,
            streams=streams,
        )
        options = _autograd_options(model, compiled_autograd_options, device)
        self.compiled_autograd_options: dict[str, Any] = options
        self._step_context = functools.partial(_compiled_autograd, torch.compile(**options))

    def get_compiled_autograd_ctx(self) -> contextlib.AbstractContextManager[None]:
        """The context each step runs in (torchrec's method, for a custom `progress()`)."""
        return self._step_context()


@contextlib.contextmanager
def _compiled_autograd(compiler: Callable[..., Any]) -> Iterator[None]:
    with (
        torch._dynamo.config.patch(DYNAMO_SETTINGS),
        torch._functorch.config.patch(_AUTOGRAD_FUNCTORCH),
        torch._inductor.config.patch(_AUTOGRAD_INDUCTOR),
        torchrec_use_sync_collectives(),
        torch._dynamo.compiled_autograd._enable(compiler),
    ):
        yield


def _autograd_options(model: nn.Module, given: dict[str, Any] | None, device: torch.device) -> dict[str, Any]:
    if given is not None and not isinstance(given, dict):
        raise ValueError(
            f"compiled_autograd_options must be a dict of torch.compile arguments; got {given!r}"
        )
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
