"""The stashing pipelines on 2 gloo ranks: OptStash (the optimizer state in host memory between
steps), EmbStash (marked embedding weights in host memory between lookup and backward) and
PrefetchEMS (EmbStash with the prefetch of batch i+1 before backward of i).

Their documented semantics, checked on CPU: the numbers are the plain loop's, bit for bit (the
memory comes back byte for byte before it is read); and the memory is really gone while it is
lent: the storages are empty (0 bytes) at the points the docs say, and back where they say. The
negative twin of the memory claim is TrainPipelineSparseDist on the same model, whose storages
are never empty. Table-wise, column-wise, and both in one collection (tests/user_models.py);
distinct batches per rank; one scenario a test.
"""

from __future__ import annotations

import tempfile

import pytest

from tests.harness import pytest_timeout

STEPS = 6
TIMEOUT = 150
pytestmark = pytest.mark.timeout(pytest_timeout(TIMEOUT))
DLRM_TABLES = ("t0", "t1", "t2")
USER_TABLES = ("st0", "st1", "st2", "ht0")
EBC = "model.sparse_arch.embedding_bag_collection"


def _adam(model):
    """A dense optimizer with state (Adam), for the optimizer-state stash."""
    import torch
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    dense = dict(in_backward_optimizer_filter(model.named_parameters()))
    return KeyedOptimizerWrapper(dense, lambda params: torch.optim.Adam(params, lr=0.01))


def _build(kind: str, sharding: str, stash: tuple[str, ...] = ()):
    from tests import models, user_models

    if kind in user_models.PATTERNS:
        return user_models.build(kind, stash=stash)
    return models.build(kind, sharding, stash=stash)


def _batches(kind: str, rank: int) -> list:
    from tests import models, user_models

    if kind in user_models.PATTERNS:
        return user_models.batches(STEPS, rank)
    return models.batches(kind, STEPS, rank)


def _storage_bytes(tensors) -> list[int]:
    return [t.untyped_storage().nbytes() for t in tensors]


# -- OptStash ---------------------------------------------------------------------------------


def _opt_state(opt) -> list:
    from pipeline.stages.stash import tensors_in

    return tensors_in(opt.state)


def _opt_stash_case(rank: int, world_size: int, kind: str, sharding: str, site: str, twin: bool) -> dict:
    import torch
    from torchrec.distributed.types import ShardingType

    import pipeline
    from tests import models

    ref, _ = _build(kind, sharding)
    ref_opt = _adam(ref)
    expected = models.plain_loop(ref, ref_opt, _batches(kind, rank))
    model, _ = _build(kind, sharding)
    opt = _adam(model)
    device = torch.device("cpu")
    if twin:
        pipe = pipeline.TrainPipelineSparseDist(model, opt, device)
    else:
        pipe = pipeline.TrainPipelineSparseDistOptStash(
            model, opt, device, site, ShardingType(sharding), stash_min_bytes=0
        )
    seen: dict[str, list[int]] = {"before_site": [], "after_site": []}
    if kind == "dlrm":  # the over arch is differentiated before the site, the dense arch after it
        for name, fqn in (("before_site", "model.over_arch"), ("after_site", "model.dense_arch")):
            where = pipeline.InjectionSite(
                fqn, pipeline.FirstGradTensorFinder(), pipeline.InjectionTargetType.PARAM_GRAD
            )
            pipe.register_backward_hook(
                where, lambda p, n=name: seen[n].append(sum(_storage_bytes(_opt_state(opt))))
            )
    it, outputs, between = iter(_batches(kind, rank)), [], []
    for _ in range(STEPS):
        outputs.append(pipe.progress(it))
        between.append(sum(_storage_bytes(_opt_state(opt))))
    try:
        pipe.progress(it)
        stopped = False
    except StopIteration:
        stopped = True
    pipe.detach()  # gives the state back
    return {
        "outputs": models.bitwise_equal(expected, outputs),
        "params": models.bitwise_equal(ref.state_dict(), model.state_dict()),
        "state": models.bitwise_equal(_opt_state(ref_opt), _opt_state(opt)) and len(_opt_state(opt)) > 0,
        "stopped": stopped,
        "between": between,
        "seen": seen,
    }


OPT_CASES = [
    ("dlrm", "table_wise", EBC),
    ("dlrm", "column_wise", EBC),
    ("split", "table_wise", "a"),
]


@pytest.mark.parametrize(("kind", "sharding", "site"), OPT_CASES)
def test_opt_stash_lends_the_state_between_steps_with_the_plain_loops_numbers(pool, kind, sharding, site):
    for rank, r in enumerate(pool.run(_opt_stash_case, kind, sharding, site, False, timeout=TIMEOUT)):
        where = f"OptStash on {kind} ({sharding}), rank {rank}"
        assert r["stopped"], f"{where}: no StopIteration after {STEPS} outputs"
        assert r["outputs"], f"{where}: per-step outputs differ from the plain loop"
        assert r["params"], f"{where}: final parameters differ from the plain loop"
        assert r["state"], f"{where}: the optimizer state given back differs from the plain loop's"
        assert r["between"] == [0] * STEPS, f"{where}: state bytes left between steps: {r['between']}"
        if kind == "dlrm":  # still lent before backward reaches the site, back after it
            assert all(b > 0 for b in r["seen"]["after_site"][1:]), (
                f"{where}: not restored at the site: {r['seen']}"
            )
            assert r["seen"]["before_site"][1:] == [0] * (STEPS - 1), f"{where}: restored early: {r['seen']}"


def test_opt_stash_twin_sparse_dist_keeps_the_state(pool):
    for rank, r in enumerate(pool.run(_opt_stash_case, "dlrm", "table_wise", EBC, True, timeout=TIMEOUT)):
        assert r["outputs"] and r["state"], f"rank {rank}: SparseDist with Adam is not the plain loop"
        assert all(b > 0 for b in r["between"]), f"rank {rank}: SparseDist freed the state: {r['between']}"


# -- EmbStash and PrefetchEMS ---------------------------------------------------------------------


def _kernels(model) -> list:
    """(weights, marked) of every embedding kernel of this rank."""
    out = []
    for module in model.modules():
        for lookup in getattr(module, "_lookups", None) or ():
            for kernel in getattr(lookup, "_emb_modules", ()):
                marked = any(t.stash_weights for t in kernel._config.embedding_tables)
                out.append((kernel._emb_module.weights_host, marked))
    return out


EMB_POINTS = {
    # module run after every lookup, site (a dense module differentiated before the kernels)
    "dlrm": ("model.over_arch", "model.over_arch", "model.inter_arch"),
    "split": ("head", "head", None),
}


def _emb_stash_case(rank: int, world_size: int, name: str, kind: str, sharding: str, options: dict) -> dict:
    """`name` with every table marked; per step, at the forward of the module run after the
    lookups: which kernels' weights are empty."""
    import torch

    import pipeline
    from tests import models

    tables = DLRM_TABLES if kind == "dlrm" else USER_TABLES
    ref, ref_opt = _build(kind, sharding, stash=tables)
    expected = models.plain_loop(ref, ref_opt, _batches(kind, rank))
    model, opt = _build(kind, sharding, stash=tables)
    after_lookups, site, before = EMB_POINTS[kind]
    args = () if name == "TrainPipelineSparseDist" else (site,)
    # "late": no tuner, whose prediction runs forwards of its own (which lend nothing)
    pipe = getattr(pipeline, name)(
        model, opt, torch.device("cpu"), *args, input_dist_schedule="late", **options
    )
    kernels = _kernels(model)
    empty_at: dict[str, list] = {"after_lookups": [], "before": [], "between": []}
    root = model.module
    root.get_submodule(after_lookups).register_forward_hook(
        lambda *a: empty_at["after_lookups"].append([w.untyped_storage().nbytes() == 0 for w, _ in kernels])
    )
    if before is not None:  # run after the lookups, before `after_lookups`
        root.get_submodule(before).register_forward_pre_hook(
            lambda *a: empty_at["before"].append([w.untyped_storage().nbytes() == 0 for w, _ in kernels])
        )
    it, outputs = iter(_batches(kind, rank)), []
    for _ in range(STEPS):
        outputs.append(pipe.progress(it))
        empty_at["between"].append([w.untyped_storage().nbytes() == 0 for w, _ in kernels])
    stopped = models.run_to_end(pipe, it) == []
    return {
        "outputs": models.bitwise_equal(expected, outputs),
        "params": models.bitwise_equal(ref.state_dict(), model.state_dict()),
        "stopped": stopped,
        "marked": [marked for _, marked in kernels],
        "empty_at": empty_at,
    }


EMB_CASES = [
    ("TrainPipelineSparseDistEmbStash", "dlrm", "table_wise", {}),
    ("TrainPipelineSparseDistEmbStash", "dlrm", "column_wise", {}),
    ("TrainPipelineSparseDistEmbStash", "split", "mixed", {}),
    ("TrainPipelinePrefetchEMS", "dlrm", "table_wise", {}),
    ("TrainPipelinePrefetchEMS", "split", "mixed", {}),
]


@pytest.mark.parametrize(("name", "kind", "sharding", "options"), EMB_CASES)
def test_embedding_weights_are_lent_from_lookup_to_backward(pool, name, kind, sharding, options):
    for rank, r in enumerate(pool.run(_emb_stash_case, name, kind, sharding, options, timeout=TIMEOUT)):
        where = f"{name} on {kind} ({sharding}), rank {rank}"
        assert r["stopped"], f"{where}: no StopIteration after {STEPS} outputs"
        assert r["outputs"], f"{where}: per-step outputs differ from the plain loop"
        assert r["params"], f"{where}: final parameters differ from the plain loop"
        assert any(r["marked"]), f"{where}: no kernel holds a marked table"
        lent = [r["marked"]] * STEPS
        assert r["empty_at"]["after_lookups"] == lent, f"{where}: not lent during forward: {r['empty_at']}"
        assert not any(any(e) for e in r["empty_at"]["between"]), f"{where}: not given back after the step"


def test_emb_stash_twin_sparse_dist_lends_nothing(pool):
    r = pool.run(_emb_stash_case, "TrainPipelineSparseDist", "dlrm", "table_wise", {}, timeout=TIMEOUT)
    for rank, result in enumerate(r):
        assert result["outputs"], f"rank {rank}: SparseDist is not the plain loop"
        assert not any(any(e) for e in result["empty_at"]["after_lookups"]), f"rank {rank}: weights were lent"


@pytest.mark.parametrize("stash_site", [None, "model.over_arch"])
def test_emb_stash_delayed_stash(pool, stash_site):
    options = {"delay_stash": True, "stash_site_fqn": stash_site}
    results = pool.run(
        _emb_stash_case, "TrainPipelineSparseDistEmbStash", "dlrm", "table_wise", options, timeout=TIMEOUT
    )
    for rank, r in enumerate(results):
        where = f"EmbStash delayed to {stash_site or 'the backward site'}, rank {rank}"
        assert r["outputs"] and r["params"], f"{where}: not the plain loop"
        nothing = [[False] * len(r["marked"])] * STEPS
        assert r["empty_at"]["before"] == nothing, f"{where}: stashed before the stash site: {r['empty_at']}"
        expected = [r["marked"]] * STEPS if stash_site else nothing
        assert r["empty_at"]["after_lookups"] == expected, f"{where}: {r['empty_at']}"


def _ems_tiered_case(rank: int, world_size: int, sharding: str) -> dict:
    """PrefetchEMS on the tiered kernel (whose prefetch() moves rows from disk) against the plain
    loop on the same kernel."""
    import torch

    import pipeline
    from tests import models
    from tests.test_tiered_dist import STEPS as N
    from tests.test_tiered_dist import _batches as tiered_batches
    from tests.test_tiered_dist import _build as tiered_build

    data = tiered_batches(N, rank)
    with tempfile.TemporaryDirectory() as d:
        ref, ref_opt = tiered_build(sharding, d)
        expected = models.plain_loop(ref, ref_opt, data)
        expected_state = [t.clone() for t in models.flat_tensors(ref.state_dict())]
    with tempfile.TemporaryDirectory() as d:
        model, opt = tiered_build(sharding, d)
        pipe = pipeline.TrainPipelinePrefetchEMS(model, opt, torch.device("cpu"), "model.over_arch")
        outputs, stopped = models.outputs_then_stop(pipe, iter(data), N)
        stats = model.module.model.sparse_arch.embedding_bag_collection.tiered_stats()
        return {
            "outputs": models.bitwise_equal(expected, outputs),
            "params": models.bitwise_equal(expected_state, models.flat_tensors(model.state_dict())),
            "stopped": stopped,
            "prefetches": sum(s["prefetches"] for s in stats.values()),
            "count": N,
        }


@pytest.mark.parametrize("sharding", ["table_wise", "column_wise"])
def test_prefetch_ems_on_a_kernel_that_prefetches(pool, sharding):
    for rank, r in enumerate(pool.run(_ems_tiered_case, sharding, timeout=TIMEOUT)):
        where = f"PrefetchEMS on the tiered kernel ({sharding}), rank {rank}"
        assert r["stopped"], f"{where}: no StopIteration"
        assert r["outputs"], f"{where}: per-step outputs differ from the plain loop"
        assert r["params"], f"{where}: final parameters differ from the plain loop"
        assert r["prefetches"] >= r["count"], f"{where}: the prefetch stage did not run: {r['prefetches']}"
