"""TrainPipelinePT2: the model compiled by torch.compile after its first steps (the backward under
compiled autograd: `pipeline.pipelines.comp_autograd`).

Both run on CPU (inductor builds its kernels with the machine's C++ compiler). torchrec's dynamo
settings for torchrec models are applied only around the pipeline's own calls
(`torch._dynamo.config.patch`), not left set for the whole process as torchrec's classes leave
them. Where torchrec's classes fail on CPU, and why, is in docs/reference.md ("PT2").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torchrec.pt2.utils import kjt_for_pt2_tracing
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from pipeline.config import RankOptions, TorchCompileConfig, fields_in
from pipeline.pipelines.base import TrainPipelineBase
from pipeline.stages.streams import Streams

__all__ = [
    "DYNAMO_SETTINGS",
    "CompiledForward",
    "TorchCompileConfig",
    "TrainPipelinePT2",
    "compile_config",
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


def compile_config(given: Any) -> TorchCompileConfig:
    """`given` as our `TorchCompileConfig` (torchrec's is read field by field); None: the defaults."""
    if given is None:
        return TorchCompileConfig()
    if isinstance(given, TorchCompileConfig):
        return given
    fields = ("fullgraph", "dynamic", "backend", "compile_on_iter")
    return TorchCompileConfig(**{f: getattr(given, f) for f in fields})


class CompiledForward:
    """The forward of `TrainPipelinePT2`: the model un-compiled for `compile_on_iter` calls, then
    compiled in place (`nn.Module.compile`, as torchrec does), each batch passed through the input
    transformer first and traced under `DYNAMO_SETTINGS`."""

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
        self.calls = 0
        """Forward calls so far (training and eval, as torchrec counts them)."""
        self._pre, self._post = pre_compile_fn, post_compile_fn
        self._transform = input_transformer or pt2_input_transformer

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
        config = self.config
        if self._pre is not None:
            self._pre(self.model)
        torch.ops.import_module("fbgemm_gpu.sparse_ops")  # fake kernels of fbgemm's sparse ops
        self.model.compile(fullgraph=config.fullgraph, dynamic=config.dynamic, backend=config.backend)
        if self._post is not None:
            self._post(self.model)


class TrainPipelinePT2(TrainPipelineBase):
    """`TrainPipelineBase` with the model compiled by torch.compile from step `compile_on_iter` on.

    Args (torchrec's, in its order):
        model: the model; `model(batch)` returns `(loss, output)` in training mode.
        optimizer: stepped after each training batch's backward.
        device: where batches are copied to.
        compile_configs: a `TorchCompileConfig` (ours or torchrec's); None: its defaults
            (inductor, compiled before the fourth step).
        pre_compile_fn, post_compile_fn: called with the model before and after it is compiled.
        input_transformer: applied to each batch on the device, right before forward; None:
            `pt2_input_transformer` (every KJT of the batch prepared for tracing).

    Keyword-only, ours: streams, and the fields of `RankOptions` (`ranks` may give them), as in
    `TrainPipelineBase`.

    Unlike torchrec's class, the copy of batch i+1 overlaps the compute of batch i (Base's step);
    the numbers are the plain compiled loop's.
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
        on_uneven: str | None = None,
        check_keys: bool | None = None,
        check_kjts: bool | None = None,
        agreement: bool | None = None,
        abort_on_error: bool | None = None,
        failure_grace: float | None = None,
        peer_timeout: timedelta | None = None,
    ) -> None:
        self._compiled = CompiledForward(
            model,
            compile_config(compile_configs),
            pre_compile_fn=pre_compile_fn,
            post_compile_fn=post_compile_fn,
            input_transformer=input_transformer,
        )
        super().__init__(
            model,
            optimizer,
            device,
            self._compiled,
            streams=streams,
            ranks=ranks,
            **fields_in(locals(), RankOptions),
        )

    @property
    def compiled(self) -> bool:
        """Whether the model has been compiled yet."""
        return self._compiled.compiled
