"""TrainPipelineSparseDistCompAutograd: SparseDist whose backward runs under compiled autograd, on
torchrec's synchronous collectives. On CPU too, with torchrec's dynamo settings only around the
pipeline's own steps, as `pipeline.pipelines.pt2` (docs/reference.md, "PT2").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torchrec.distributed.comm_ops import torchrec_use_sync_collectives

from pipeline.config import InputDistOptions, RankOptions, RewriteOptions
from pipeline.pipelines.pt2 import DYNAMO_SETTINGS
from pipeline.pipelines.sparse_dist import TrainPipelineSparseDist
from pipeline.stages.streams import Streams

__all__ = ["COMPILED_AUTOGRAD_DEFAULTS", "TrainPipelineSparseDistCompAutograd"]

COMPILED_AUTOGRAD_DEFAULTS = {"backend": "inductor", "dynamic": True, "fullgraph": True}
"""torchrec's torch.compile arguments for the backward graph (fullgraph becomes False on CPU)."""

# torchrec also sets dynamo's inline_inbuilt_nn_modules (always on since torch 2.6) and
# skip_fsdp_hooks (gone from torch 2.13); the rest of its compiled-autograd settings:
_AUTOGRAD_FUNCTORCH = {"recompute_views": True, "cse": False}
_AUTOGRAD_INDUCTOR = {
    "reorder_for_compute_comm_overlap": True,
    "reorder_for_compute_comm_overlap_passes": ["sink_waits", "raise_comms", "reorder_compute_for_overlap"],
}


class TrainPipelineSparseDistCompAutograd(TrainPipelineSparseDist):
    """`TrainPipelineSparseDist` whose backward runs under compiled autograd, and whose forward and
    backward use torchrec's synchronous collectives (which compiled autograd can trace).

    Args (torchrec's, in its order): those of `TrainPipelineSparseDist` without
    `dmp_collection_sync_interval_batches`, `enqueue_batch_after_forward` and
    `enable_inplace_copy_batch`.

    Keyword-only, ours: `compiled_autograd_options` (torch.compile arguments for the backward
    graph; None: the model's `_compiled_autograd_options` as in torchrec, else
    `COMPILED_AUTOGRAD_DEFAULTS`, with fullgraph=False on CPU), then those of our
    `TrainPipelineSparseDist`.

    Raises:
        ValueError: the model holds a DistributedDataParallel with its C++ reducer (the dense
            part of a DistributedModelParallel, unless `torch._dynamo.config.optimize_ddp` was
            "python_reducer" when it was built): compiled autograd cannot trace that reducer.
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
        rewrite_method: str | None = None,
        arg_paths: dict[str, Any] | None = None,
        input_dist: InputDistOptions | None = None,
        input_dist_schedule: str | None = None,
        narrow_ids: bool | None = None,
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
        _refuse_cpp_reducer(model)
        self._build(locals())
        options = _autograd_options(model, compiled_autograd_options, device)
        self.compiled_autograd_options: dict[str, Any] = options
        """The torch.compile arguments of the backward graph."""
        self._step_context = _CompiledAutograd(torch.compile(**options))

    def get_compiled_autograd_ctx(self) -> contextlib.AbstractContextManager[None]:
        """The context each step runs in (torchrec's method, for a custom `progress()`): torchrec's
        synchronous collectives and compiled autograd with `compiled_autograd_options`."""
        return self._step_context()


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
