"""Each pipeline class on a CUDA device next to its plain reference, for `tests/test_cuda.py` and the
GPU scripts (`scripts/gpu/csan.py`, `scripts/gpu/memory.py`); run inside a harness rank (NCCL).

`run_case(name, kind, sharding, ...)` trains `tests/models`' model with the pipeline `name` (one of
`CLASSES`, or "torchrec.<class>" for torchrec's own) and with its reference, and reports whether the
per-step outputs and final parameters are bit for bit equal, what the keep-alive kept, and the
peak memory of the pipeline's run. The references: the plain loop (zero_grad, forward, backward,
step); for Eval, the model's outputs in eval mode without gradients; for PT2 and CompAutograd, the
plain loop compiled the same way (aot_eager on CUDA: eager's kernels, so bit for bit is the
contract; dynamo alone, backend "eager", in the CPU dry run, which checks the case's wiring and
takes a third of the time: tests/test_pt2.py holds aot_eager on CPU); for
Staged "+lookup", `models.stale_lookup_loop` (its lookup of batch i+1 runs before batch i's update).
"""

from __future__ import annotations

from typing import Any

import torch

from tests import models

__all__ = ["CLASSES", "HOST_ONLY", "OPTIONS", "STEPS", "run_case"]

STEPS = 20
CLASSES = (
    "TrainPipelineBase",
    "TrainPipelineSparseDist",
    "PrefetchTrainPipelineSparseDist",
    "TrainPipelineFusedSparseDist",
    "TrainPipelineSemiSync",
    "EvalPipelineSparseDist",
    "StagedTrainPipeline",
    "TrainPipelinePT2",
    "TrainPipelineSparseDistCompAutograd",
    "TrainPipelineSparseDistLite",
    "TrainPipelineSparseDistT",
    "TrainEvalHybridPipelineBase",
    "TrainPipelineSparseDistBwdOpt",
    "TrainPipelineSparseDistOptStash",
    "TrainPipelineSparseDistEmbStash",
    "TrainPipelinePrefetchEMS",
    "TrainPipelinePEC",
    "EvalPipelineFusedSparseDist",
    "EvalPipelineCPUSparse",
    "StagedTrainPipeline+prefetch",
    "StagedTrainPipeline+lookup",
)
"""Staged "+prefetch" / "+lookup": SparseDataDistUtil's prefetch or embedding-lookup stage after its
input_dist stage."""
HOST_ONLY = ("EvalPipelineCPUSparse",)
"""Classes whose sharded modules run on the host: `tests/models` puts the whole model on one device,
so these run on the CPU (the dry run) only."""
_EBC = "model.sparse_arch.embedding_bag_collection"
OPTIONS: dict[str, dict[str, Any]] = {
    "TrainPipelineSparseDistBwdOpt": {"site_fqn": _EBC},
    "TrainPipelineSparseDistOptStash": {"site_fqn": _EBC, "stash_min_bytes": 0},
    "TrainPipelineSparseDistEmbStash": {"site_fqn": "model.over_arch"},
    "TrainPipelinePrefetchEMS": {"site_fqn": "model.over_arch"},
}
"""The classes that need a site of the model: its DLRM's modules (these run the "dlrm" kind only)."""
_STASHED = {
    "TrainPipelineSparseDistEmbStash": ("t0", "t1", "t2"),
    "TrainPipelinePrefetchEMS": ("t0", "t1", "t2"),
}
"""The DLRM tables marked for the embedding stash."""
_DYNAMO = {
    "capture_scalar_outputs": True,
    "capture_dynamic_output_shape_ops": True,
    "force_unspec_int_unbacked_size_like_on_torchrec_kjt": True,
    "skip_torchrec": False,
}
_AUTOGRAD = {"dynamic": True, "fullgraph": False}


def _backend(device: torch.device) -> str:
    """The compile backend of the PT2 and CompAutograd cases: see the module's docstring."""
    return "aot_eager" if device.type == "cuda" else "eager"


def run_case(
    name: str,
    kind: str,
    sharding: str,
    *,
    cache: Any = None,
    handoff: str = "keep-alive",
    steps: int = STEPS,
    device: torch.device | None = None,
) -> dict:
    """Train with pipeline `name` and with its reference on the current CUDA device (`device`
    "cpu": on `RecordingStreams`, a dry run of the same code without a GPU)."""
    if name in OPTIONS and kind != "dlrm":
        raise ValueError(f"{name} runs on the 'dlrm' kind only (its site is a DLRM module); got {kind!r}")
    device = device or torch.device("cuda", torch.cuda.current_device())
    if name in HOST_ONLY and device.type == "cuda":
        raise ValueError(f"{name} wants its sharded modules on the host: run it with device cpu")
    on_gpu = device.type == "cuda"
    data = models.batches(kind, steps, rank=0)
    build = _builder(name, kind, sharding, device, cache)
    ref_model, ref_opt = build()
    expected = _reference(name, ref_model, ref_opt, [_on(b, device) for b in data], _backend(device))
    model, opt = build()
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if on_gpu else 0
    outputs, streams, report = _train(name, model, opt, device, data, handoff)
    if on_gpu:
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(device) - base if on_gpu else 0
    kept_at_end = None
    if streams is not None:
        streams.wait_all()
        kept_at_end = streams.kept
    return {
        "outputs_equal": models.bitwise_equal(expected, outputs),
        "params_equal": models.bitwise_equal(ref_model.state_dict(), model.state_dict()),
        "count": len(outputs),
        "on_device": all(o.device == device for o in models.flat_tensors(outputs)),
        "not_pipelined": None if report is None else [m.fqn for m in report.not_pipelined],
        "kept_at_end": kept_at_end,
        "kept_peak": None if streams is None else streams.keep_alive.peak,
        "peak_bytes": peak,
    }


def _on(batch: Any, device: torch.device) -> Any:
    from pipeline.pipelines.core import to_device

    return to_device(batch, device, non_blocking=False)


def _builder(name: str, kind: str, sharding: str, device: torch.device, cache: Any):
    def build():
        if name.endswith("CompAutograd"):  # compiled autograd traces DDP's Python reducer only
            with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
                model, opt = models.build(kind, sharding, device=device, cache=cache)
            model._compiled_autograd_options = {**_AUTOGRAD, "backend": _backend(device)}
            return model, opt
        stash = _STASHED.get(name, ())
        model, opt = models.build(kind, sharding, device=device, cache=cache, stash=stash)
        if name.startswith("Eval"):
            model.eval()
        return model, opt

    return build


def _reference(name: str, model, opt, data: list, backend: str) -> list:
    if name.startswith("Eval"):
        with torch.no_grad():
            return [model(b)[1] for b in data]
    if name.endswith("PT2"):
        return _compiled_loop(model, opt, data, backend)
    if name.endswith("CompAutograd"):
        return _compiled_autograd_loop(model, opt, data, backend)
    if name == "StagedTrainPipeline+lookup":  # semi-synchronous: embeddings one step stale
        return models.stale_lookup_loop(model, opt, data)
    return models.plain_loop(model, opt, data)


def _train(name: str, model, opt, device, data: list, handoff: str) -> tuple[list, Any, Any]:
    """The pipeline's outputs, its streams and its rewrite report (None where it has none)."""
    import pipeline
    from tests import streamcheck

    if name.startswith("torchrec."):
        from torchrec.distributed import train_pipeline

        pipe = getattr(train_pipeline, name.removeprefix("torchrec."))(model, opt, device)
        return models.run_to_end(pipe, iter(data)), None, None
    if device.type == "cuda":
        streams = pipeline.CudaStreams(device, handoff=handoff)
    else:
        streams = streamcheck.RecordingStreams(handoff=handoff)
    if name.startswith("StagedTrainPipeline"):
        outputs, report = _staged(model, opt, device, data, streams, name.partition("+")[2])
        return outputs, streams, report
    options: dict[str, Any] = {"streams": streams, **OPTIONS.get(name, {})}
    if name == "TrainPipelinePT2":
        options["compile_configs"] = pipeline.TorchCompileConfig(backend=_backend(device), compile_on_iter=2)
    pipe = getattr(pipeline, name)(model, opt, device, **options)
    return models.run_to_end(pipe, iter(data)), streams, getattr(pipe, "rewrite_report", None)


def _staged(model, opt, device, data: list, streams, extra: str) -> tuple[list, Any]:
    """The copy on the memcpy stream, SparseDataDistUtil's stage on data_dist, with `extra`
    ("prefetch" or "lookup") its prefetch or lookup stage on the prefetch stream; the caller's loop."""
    import pipeline
    from pipeline.pipelines.core import to_device

    extra_stream = {"prefetch": "prefetch_stream", "lookup": "embedding_lookup_stream"}
    options = {extra_stream[extra]: streams.prefetch} if extra else {}
    sdd = pipeline.SparseDataDistUtil(model, streams.data_dist, streams=streams, **options)
    stages = [
        pipeline.PipelineStage("copy", lambda b: to_device(b, device, True), stream=streams.memcpy),
        sdd.start_sparse_data_dist_stage(),
    ]
    if extra == "prefetch":
        stages.append(pipeline.PipelineStage("prefetch", sdd.prefetch, stream=streams.prefetch))
    elif extra == "lookup":
        stages.append(sdd.start_embedding_lookup_stage())
    pipe = pipeline.StagedTrainPipeline(stages, streams=streams)
    it, outputs = iter(data), []
    while (batch := pipe.progress(it)) is not None:
        opt.zero_grad()
        loss, out = model(batch)
        torch.sum(loss).backward()
        opt.step()
        outputs.append(out)
    report = sdd.rewrite_report  # before detach() restores the model
    sdd.detach()
    return outputs, report


def _traceable(batch: Any) -> Any:
    """torchrec's own KJT preparation on the DLRM batch's one KJT (PT2 runs on "dlrm" only)."""
    from torchrec.datasets.utils import Batch
    from torchrec.pt2.utils import kjt_for_pt2_tracing

    return Batch(batch.dense_features, kjt_for_pt2_tracing(batch.sparse_features), batch.labels)


def _compiled_loop(model, opt, data: list, backend: str) -> list:
    """The plain loop, compiled with `backend` before the third batch (as the PT2 case)."""
    outputs = []
    for i, batch in enumerate(data):
        with torch._dynamo.config.patch(_DYNAMO):
            if i == 2:
                model.compile(backend=backend)
            opt.zero_grad()
            loss, out = model(_traceable(batch))
        torch.sum(loss).backward()
        opt.step()
        outputs.append(out)
    return outputs


def _compiled_autograd_loop(model, opt, data: list, backend: str) -> list:
    """The plain loop on torchrec's sync collectives, its backward under compiled autograd."""
    from torchrec.distributed.comm_ops import torchrec_use_sync_collectives

    compiler = torch.compile(**_AUTOGRAD, backend=backend)
    outputs = []
    for batch in data:
        opt.zero_grad()
        with torchrec_use_sync_collectives():
            loss, out = model(batch)
        with (
            torch._dynamo.config.patch(_DYNAMO),
            torch._functorch.config.patch({"recompute_views": True, "cse": False}),  # torchrec's
            torchrec_use_sync_collectives(),
            torch._dynamo.compiled_autograd._enable(compiler),
        ):
            torch.sum(loss).backward()
        opt.step()
        outputs.append(out)
    return outputs
