"""`TrainPipelinePT2` and `TrainPipelineSparseDistCompAutograd` with torch.compile on CPU.

On 2 gloo ranks with real all-to-alls (DLRM, table-wise and column-wise), each pipeline gives the
outputs and final parameters of the plain compiled loop written here: the same model built the same
way, compiled the same way (torchrec's dynamo settings and KJT hints, typed out below from torchrec's
classes, not taken from ours), one output per batch and then StopIteration. Each scenario resets
dynamo, runs the pipeline (which must have compiled: graphs counted, `nn.Module.compile` seen after
the right step), then the loop in the same processes: the loop's calls find the pipeline's graphs
in dynamo's cache when their guards (backend, sizes, global state) pass, as a second model compiled
the same way in one process would, and it costs no second compile.

Tolerance: with `aot_eager` the compiled graphs run eager's ATen kernels, so the pipeline must be
bit for bit equal to the loop. With inductor the comparison is `torch.testing.assert_close` at its
float32 defaults (rtol 1.3e-6, atol 1e-5; torch's test comparisons default to them, inductor's
tests against eager included): two compilations of one graph are not promised the same kernels
(reduction order and vectorisation follow the sizes each one specialised), and the loop recompiles
wherever a guard fails, so bit-equality is not torch.compile's contract. The scenarios report
whether they were bitwise anyway (they were, on this machine).

Compile time dominates: one small model, few steps.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torchrec.distributed.train_pipeline import train_pipelines as torchrec_pipelines

import pipeline
from tests.harness import pytest_timeout

TIMEOUT = 240
STEPS = 5
pytestmark = [pytest.mark.timeout(pytest_timeout(TIMEOUT)), pytest.mark.slow]

# torchrec 1.8's TrainPipelinePT2 sets these before compiling; its CompAutograd class these:
TORCHREC_DYNAMO = {
    "capture_scalar_outputs": True,
    "capture_dynamic_output_shape_ops": True,
    "force_unspec_int_unbacked_size_like_on_torchrec_kjt": True,
    "skip_torchrec": False,
}
TORCHREC_FUNCTORCH = {"recompute_views": True, "cse": False}
TORCHREC_INDUCTOR = {
    "reorder_for_compute_comm_overlap": True,
    "reorder_for_compute_comm_overlap_passes": ["sink_waits", "raise_comms", "reorder_compute_for_overlap"],
}


def _traceable(batch):
    """torchrec's own KJT preparation (kjt_for_pt2_tracing) on the DLRM batch's one KJT."""
    from torchrec.datasets.utils import Batch
    from torchrec.pt2.utils import kjt_for_pt2_tracing

    return Batch(batch.dense_features, kjt_for_pt2_tracing(batch.sparse_features), batch.labels)


def _compiled_loop(model, opt, data, backend: str, compile_on_iter: int) -> list:
    """The plain loop, the model compiled in place before batch `compile_on_iter`."""
    outputs = []
    for i, batch in enumerate(data):
        with torch._dynamo.config.patch(TORCHREC_DYNAMO):
            if i == compile_on_iter:
                model.compile(backend=backend)
            opt.zero_grad()
            loss, out = model(_traceable(batch))
        torch.sum(loss).backward()
        opt.step()
        outputs.append(out)
    return outputs


def _compiled_autograd_loop(model, opt, data, options: dict) -> list:
    """The plain loop with torchrec's sync collectives, the backward under compiled autograd."""
    from torchrec.distributed.comm_ops import torchrec_use_sync_collectives

    compiler = torch.compile(**options)
    outputs = []
    for batch in data:
        opt.zero_grad()
        with torchrec_use_sync_collectives():
            loss, out = model(batch)
        with (
            torch._dynamo.config.patch(TORCHREC_DYNAMO),
            torch._functorch.config.patch(TORCHREC_FUNCTORCH),
            torch._inductor.config.patch(TORCHREC_INDUCTOR),
            torchrec_use_sync_collectives(),
            torch._dynamo.compiled_autograd._enable(compiler),
        ):
            torch.sum(loss).backward()
        opt.step()
        outputs.append(out)
    return outputs


def _compare(expected, outputs, ref_model, model) -> dict:
    from tests import models

    def close(a, b) -> str | None:
        ta, tb = models.flat_tensors(a), models.flat_tensors(b)
        if len(ta) != len(tb) or not ta:
            return f"{len(ta)} tensors against {len(tb)}"
        try:
            for x, y in zip(ta, tb, strict=True):
                torch.testing.assert_close(y, x)
        except AssertionError as e:
            return str(e)
        return None

    return {
        "outputs_close": close(expected, outputs),
        "params_close": close(ref_model.state_dict(), model.state_dict()),
        "outputs_bitwise": models.bitwise_equal(expected, outputs),
        "params_bitwise": models.bitwise_equal(ref_model.state_dict(), model.state_dict()),
    }


def _pt2_case(rank: int, world_size: int, backend: str, sharding: str, compile_on_iter: int) -> dict:
    from tests import models

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, opt = models.build("dlrm", sharding)
    config = pipeline.TorchCompileConfig(backend=backend, compile_on_iter=compile_on_iter)
    pipe = pipeline.TrainPipelinePT2(model, opt, torch.device("cpu"), config)
    it = iter(models.batches("dlrm", STEPS, rank))
    outputs, compiled_after = [], []
    for _ in range(STEPS):
        outputs.append(pipe.progress(it))
        compiled_after.append(model._compiled_call_impl is not None)  # set by nn.Module.compile
    _, stopped = models.outputs_then_stop(pipe, it, 0)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]

    ref_model, ref_opt = models.build("dlrm", sharding)
    expected = _compiled_loop(
        ref_model, ref_opt, models.batches("dlrm", STEPS, rank), backend, compile_on_iter
    )
    return {
        **_compare(expected, outputs, ref_model, model),
        "n": len(outputs),
        "stopped": stopped,
        "compiled_after": compiled_after,
        "graphs": graphs,
    }


def _comp_autograd_case(rank: int, world_size: int, backend: str, sharding: str) -> dict:
    from tests import models

    options = {"backend": backend, "dynamic": True, "fullgraph": False}
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch._dynamo.config.patch(optimize_ddp="python_reducer"):  # else DDP's C++ reducer
        model, opt = models.build("dlrm", sharding)
        ref_model, ref_opt = models.build("dlrm", sharding)
    model._compiled_autograd_options = options  # torchrec's way to pass them
    pipe = pipeline.TrainPipelineSparseDistCompAutograd(model, opt, torch.device("cpu"))
    it = iter(models.batches("dlrm", STEPS, rank))
    outputs, stopped = models.outputs_then_stop(pipe, it, STEPS)
    captures = torch._dynamo.utils.counters["compiled_autograd"]["captures"]

    expected = _compiled_autograd_loop(ref_model, ref_opt, models.batches("dlrm", STEPS, rank), options)
    return {
        **_compare(expected, outputs, ref_model, model),
        "n": len(outputs),
        "stopped": stopped,
        "captures": captures,
        "options": pipe.compiled_autograd_options,
        "not_pipelined": [m.fqn for m in pipe.rewrite_report.not_pipelined],
    }


def _cpp_reducer_case(rank: int, world_size: int) -> dict:
    from tests import models

    model, opt = models.build("dlrm", "table_wise")
    try:
        pipeline.TrainPipelineSparseDistCompAutograd(model, opt, torch.device("cpu"))
    except ValueError as e:
        return {"error": str(e)}
    return {"error": None}


def _check(results: list[dict], *, bitwise: bool) -> None:
    for rank, r in enumerate(results):
        assert r["n"] == STEPS and r["stopped"], (
            f"rank {rank}: {r['n']} outputs, then StopIteration: {r['stopped']}"
        )
        assert r["outputs_close"] is None, f"rank {rank}: outputs differ from the loop: {r['outputs_close']}"
        assert r["params_close"] is None, f"rank {rank}: parameters differ from the loop: {r['params_close']}"
        if bitwise:
            assert r["outputs_bitwise"] and r["params_bitwise"], (
                f"rank {rank}: not bit for bit under aot_eager"
            )


def test_pt2_equals_the_compiled_loop_aot_eager(pool):
    results = pool.run(_pt2_case, "aot_eager", "table_wise", 2, timeout=TIMEOUT)
    _check(results, bitwise=True)
    for r in results:
        # un-compiled for the first two steps, as torchrec's compile_on_iter; then compiled
        assert r["compiled_after"] == [False, False, True, True, True], r["compiled_after"]
        assert r["graphs"] > 0, "the pipeline's steps ran no compiled graph"


def test_pt2_equals_the_compiled_loop_inductor(pool):
    # the one inductor case (its C++ kernels built by gcc): compiled from the first step
    results = pool.run(_pt2_case, "inductor", "column_wise", 0, timeout=TIMEOUT)
    _check(results, bitwise=False)
    for r in results:
        assert all(r["compiled_after"]) and r["graphs"] > 0, r


def test_comp_autograd_equals_the_compiled_autograd_loop(pool):
    results = pool.run(_comp_autograd_case, "aot_eager", "column_wise", timeout=TIMEOUT)
    _check(results, bitwise=True)
    for r in results:
        assert r["captures"] > 0, "no backward ran under compiled autograd"
        assert r["options"]["backend"] == "aot_eager", "the model's _compiled_autograd_options were ignored"
        assert r["not_pipelined"] == [], r


def _comp_autograd_user_case(rank: int, world_size: int, pattern: str) -> dict:
    """CompAutograd on a model users write (tests/user_models.py): its call sites pipelined.

    The captured backward runs under dynamo alone (backend "eager", static shapes: the batches have
    one shape): this scenario is about the call sites, and aot_eager's equivalence is the DLRM's
    above. Tracing it through AOT autograd with dynamic shapes took 2.5x as long (49 s against 20)."""
    from tests import models, user_models

    options = {"backend": "eager", "dynamic": False, "fullgraph": False}
    torch._dynamo.reset()
    with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
        model, opt = user_models.build(pattern)
        ref_model, ref_opt = user_models.build(pattern)
    pipe = pipeline.TrainPipelineSparseDistCompAutograd(
        model, opt, torch.device("cpu"), compiled_autograd_options=options
    )
    # Bags of one length: batches of one shape, so that the loop captures its backward once (the
    # pipeline captures twice: this model is pipelined from its second batch on).
    data = user_models.batches(STEPS, rank, bag=2)
    outputs, stopped = models.outputs_then_stop(pipe, iter(data), STEPS)
    expected = _compiled_autograd_loop(ref_model, ref_opt, user_models.batches(STEPS, rank, bag=2), options)
    report = pipe.rewrite_report
    return {
        **_compare(expected, outputs, ref_model, model),
        "n": len(outputs),
        "stopped": stopped,
        "pipelined_sites": sum(len(m.sites) for m in report.modules if m.pipelined),
        "not_pipelined": [m.fqn for m in report.not_pipelined],
    }


PATTERN = "split"


def test_comp_autograd_pipelines_every_call_site_of_a_shared_collection(pool):
    from tests.user_models import SITES

    results = pool.run(_comp_autograd_user_case, PATTERN, timeout=TIMEOUT)
    _check(results, bitwise=True)
    for rank, r in enumerate(results):
        assert r["not_pipelined"] == [], f"rank {rank}: {r['not_pipelined']} not pipelined"
        assert r["pipelined_sites"] == SITES[PATTERN], f"rank {rank}: {r['pipelined_sites']} call sites"


def test_comp_autograd_refuses_the_cpp_reducer_and_names_the_fix(pool):
    for r in pool.run(_cpp_reducer_case, timeout=TIMEOUT):
        assert r["error"] is not None and 'optimize_ddp = "python_reducer"' in r["error"], r


# -- one process, no ranks -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["TrainPipelinePT2", "TrainPipelineSparseDistCompAutograd"])
def test_signatures_are_torchrecs(name):
    theirs = [p.name for p in inspect.signature(getattr(torchrec_pipelines, name)).parameters.values()]
    params = inspect.signature(getattr(pipeline, name)).parameters.values()
    positional = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional == theirs
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params if p.name not in theirs)


def test_classes_are_what_torchrecs_derive_from():
    assert issubclass(pipeline.TrainPipelinePT2, pipeline.TrainPipelineBase)
    assert issubclass(pipeline.TrainPipelineSparseDistCompAutograd, pipeline.TrainPipelineSparseDist)
    assert issubclass(pipeline.TrainPipelinePT2, torchrec_pipelines.TrainPipeline)


def test_torch_compile_config_is_torchrecs():
    theirs, ours = torchrec_pipelines.TorchCompileConfig(), pipeline.TorchCompileConfig()
    assert vars(theirs) == {f: getattr(ours, f) for f in vars(theirs)}
    assert pipeline.TorchCompileConfig(True, False, "aot_eager", 0).fullgraph is True  # positional
    with pytest.raises(ValueError, match="compile_on_iter"):
        pipeline.TorchCompileConfig(compile_on_iter=-1)
    with pytest.raises(ValueError, match="dynamic"):
        pipeline.TorchCompileConfig(dynamic="yes")
    # torchrec's config object is read field by field
    given = torchrec_pipelines.TorchCompileConfig(backend="aot_eager", compile_on_iter=1)
    from pipeline.pipelines.pt2 import compile_config

    assert compile_config(given) == pipeline.TorchCompileConfig(backend="aot_eager", compile_on_iter=1)


def test_input_transformer_finds_every_kjt_and_leaves_the_batch_alone():
    from pipeline.pipelines.pt2 import pt2_input_transformer
    from tests import models

    batch = models.batches("nested", 1, 0)[0]
    before = batch.features.user
    out = pt2_input_transformer(batch)
    assert batch.features.user is before  # the caller's batch is not modified
    for new, old in ((out.features.user, batch.features.user), (out.features.item, batch.features.item)):
        assert new is not old and new.keys() == old.keys()
        assert torch.equal(new.values(), old.values()) and torch.equal(new.lengths(), old.lengths())
    assert out.dense is batch.dense
    mapped = pt2_input_transformer({"sparse": [batch.features.user]})
    assert mapped["sparse"][0] is not batch.features.user
