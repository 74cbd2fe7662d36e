"""The embedding-stashing pipelines on 2 gloo ranks: EmbStash (marked embedding weights in host
memory between lookup and backward) and PrefetchEMS (EmbStash with the prefetch of batch i+1 before
backward of i). OptStash (the optimizer state): tests/test_opt_stash.py.

Their documented semantics, checked on CPU: the numbers are the plain loop's, bit for bit (the
memory comes back byte for byte before it is read); and the memory is really gone while it is
lent: the storages are empty (0 bytes) at the points the docs say, and back where they say. The
negative twin of the memory claim is TrainPipelineSparseDist on the same model, whose storages
are never empty, and which stashes nothing. Table-wise, column-wise, and both in one collection
(tests/user_models.py); every table marked, or one; distinct batches per rank; one scenario a test.
"""

from __future__ import annotations

import tempfile

import pytest

from tests.harness import pytest_timeout

STEPS = 6
TIMEOUT = 150
pytestmark = [pytest.mark.timeout(pytest_timeout(TIMEOUT)), pytest.mark.slow]
DLRM_TABLES = ("t0", "t1", "t2")
USER_TABLES = ("st0", "st1", "st2", "ht0")


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


def _emb_stash_case(
    rank: int, world_size: int, name: str, kind: str, sharding: str, options: dict, tables: tuple = ()
) -> dict:
    """`name` with `tables` marked (default: all); per step, at the forward of the module run after
    the lookups: which kernels' weights are empty; and how many stashes lent something."""
    import torch

    import pipeline
    from pipeline.stages.stash import Stash
    from tests import models

    tables = tables or (DLRM_TABLES if kind == "dlrm" else USER_TABLES)
    ref, ref_opt = _build(kind, sharding, stash=tables)
    expected = models.plain_loop(ref, ref_opt, _batches(kind, rank))
    model, opt = _build(kind, sharding, stash=tables)
    after_lookups, site, before = EMB_POINTS[kind]
    args = () if name == "TrainPipelineSparseDist" else (site,)
    # "late": torchrec's order from the first step to the last (no watch that may switch)
    pipe = getattr(pipeline, name)(
        model,
        opt,
        torch.device("cpu"),
        *args,
        input_dist=pipeline.InputDistOptions(schedule="late"),
        **options,
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
    it, outputs, stashes, stash = iter(_batches(kind, rank)), [], [], Stash.stash

    def counting(self, tensors) -> None:  # a stash that lends something, in this step
        tensors = list(tensors)
        stashes[-1] += any(t.untyped_storage().nbytes() > 0 for t in tensors)
        stash(self, tensors)

    Stash.stash = counting
    try:
        for _ in range(STEPS):
            stashes.append(0)
            outputs.append(pipe.progress(it))
            empty_at["between"].append([w.untyped_storage().nbytes() == 0 for w, _ in kernels])
    finally:
        Stash.stash = stash
    stopped = models.run_to_end(pipe, it) == []
    return {
        "outputs": models.bitwise_equal(expected, outputs),
        "params": models.bitwise_equal(ref.state_dict(), model.state_dict()),
        "stopped": stopped,
        "marked": [marked for _, marked in kernels],
        "empty_at": empty_at,
        "stashes": stashes,
    }


EMB_CASES = [
    ("TrainPipelineSparseDistEmbStash", "dlrm", "table_wise", ()),
    ("TrainPipelineSparseDistEmbStash", "dlrm", "column_wise", ()),
    ("TrainPipelineSparseDistEmbStash", "split", "mixed", ()),
    # one table of three marked, column-wise (a shard on each rank): the other kernel stays
    ("TrainPipelineSparseDistEmbStash", "dlrm", "column_wise", ("t0",)),
    ("TrainPipelinePrefetchEMS", "dlrm", "table_wise", ()),
    ("TrainPipelinePrefetchEMS", "split", "mixed", ()),
    ("TrainPipelinePrefetchEMS", "dlrm", "column_wise", ("t0",)),
]


@pytest.mark.parametrize(("name", "kind", "sharding", "tables"), EMB_CASES)
def test_embedding_weights_are_lent_from_lookup_to_backward(pool, name, kind, sharding, tables):
    results = pool.run(_emb_stash_case, name, kind, sharding, {}, tables, timeout=TIMEOUT)
    for rank, r in enumerate(results):
        where = f"{name} on {kind} ({sharding}, marked: {tables or 'all'}), rank {rank}"
        assert r["stopped"], f"{where}: no StopIteration after {STEPS} outputs"
        assert r["outputs"], f"{where}: per-step outputs differ from the plain loop"
        assert r["params"], f"{where}: final parameters differ from the plain loop"
        assert any(r["marked"]), f"{where}: no kernel holds a marked table"
        if tables:
            assert not all(r["marked"]), f"{where}: every kernel holds a marked table"
        assert all(n > 0 for n in r["stashes"]), f"{where}: a step lent nothing: {r['stashes']}"
        lent = [r["marked"]] * STEPS
        assert r["empty_at"]["after_lookups"] == lent, f"{where}: not lent during forward: {r['empty_at']}"
        assert not any(any(e) for e in r["empty_at"]["between"]), f"{where}: not given back after the step"


def test_emb_stash_twin_sparse_dist_lends_nothing(pool):
    r = pool.run(_emb_stash_case, "TrainPipelineSparseDist", "dlrm", "table_wise", {}, timeout=TIMEOUT)
    for rank, result in enumerate(r):
        assert result["outputs"], f"rank {rank}: SparseDist is not the plain loop"
        assert not any(any(e) for e in result["empty_at"]["after_lookups"]), f"rank {rank}: weights were lent"
        assert result["stashes"] == [0] * STEPS, f"rank {rank}: SparseDist stashed: {result['stashes']}"


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
        # without a stash site the pending stashes run at the backward site, just before the restore
        assert all(n > 0 for n in r["stashes"]), f"{where}: a step lent nothing: {r['stashes']}"


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
