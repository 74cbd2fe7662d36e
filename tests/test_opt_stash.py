"""TrainPipelineSparseDistOptStash on 2 gloo ranks: the optimizer state in host memory between
optimizer steps, given back from an injection site in backward.

Its documented semantics, checked on CPU: the numbers are the plain loop's, bit for bit (the state
comes back byte for byte before the step); the state's storages are empty (0 bytes) between steps,
still empty while backward has not reached the site, and back once it has. The negative twin is
TrainPipelineSparseDist on the same model, whose state is never freed. Table-wise, column-wise,
and both in one collection (tests/user_models.py, the site at either all-to-all); distinct batches
per rank; one scenario a test.
"""

from __future__ import annotations

import pytest

from tests.harness import pytest_timeout

STEPS = 6
TIMEOUT = 150
pytestmark = [pytest.mark.timeout(pytest_timeout(TIMEOUT)), pytest.mark.slow]
EBC = "model.sparse_arch.embedding_bag_collection"


def _adam(model):
    """A dense optimizer with state (Adam), for the optimizer-state stash."""
    import torch
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    dense = dict(in_backward_optimizer_filter(model.named_parameters()))
    return KeyedOptimizerWrapper(dense, lambda params: torch.optim.Adam(params, lr=0.01))


def _build(kind: str, sharding: str):
    from tests import models, user_models

    if kind in user_models.PATTERNS:
        return user_models.build(kind)
    return models.build(kind, sharding)


def _batches(kind: str, rank: int) -> list:
    from tests import models, user_models

    if kind in user_models.PATTERNS:
        return user_models.batches(STEPS, rank)
    return models.batches(kind, STEPS, rank)


def _storage_bytes(tensors) -> list[int]:
    return [t.untyped_storage().nbytes() for t in tensors]


def _opt_state(opt) -> list:
    from pipeline.stages.stash import tensors_in

    return tensors_in(opt.state)


def _opt_stash_case(
    rank: int, world_size: int, kind: str, sharding: str, site: str, twin: bool, end: str = "detach"
) -> dict:
    """`end`: how the state is given back once the data ends (`detach` or `reset`)."""
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
    after_stop = sum(_storage_bytes(_opt_state(opt)))
    getattr(pipe, end)()  # gives the state back
    back = all(n > 0 for n in _storage_bytes(_opt_state(opt)))
    return {
        "after_stop": after_stop,
        "back": back,
        "outputs": models.bitwise_equal(expected, outputs),
        "params": models.bitwise_equal(ref.state_dict(), model.state_dict()),
        "state": back
        and models.bitwise_equal(_opt_state(ref_opt), _opt_state(opt))
        and len(_opt_state(opt)) > 0,
        "stopped": stopped,
        "between": between,
        "seen": seen,
    }


OPT_CASES = [
    ("dlrm", "table_wise", EBC),
    ("dlrm", "column_wise", EBC),
    ("split", "table_wise", "a"),  # the site at the table-wise or the column-wise all-to-all
    ("split", "column_wise", "a"),
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


def test_opt_stash_reset_gives_the_state_back(pool):
    results = pool.run(_opt_stash_case, "split", "column_wise", "a", False, "reset", timeout=TIMEOUT)
    for rank, r in enumerate(results):
        where = f"OptStash reset after the data ended, rank {rank}"
        assert r["after_stop"] == 0, f"{where}: the state was back before reset: {r['after_stop']} bytes"
        assert r["back"], f"{where}: reset did not give every state tensor back"
        assert r["state"], f"{where}: the state given back differs from the plain loop's"


def test_opt_stash_on_one_rank_restores_after_backward(one_rank):
    """On one rank the output all-to-all is no collective: backward never reaches the site, the
    state stays lent through backward and comes back before the step, with the plain loop's numbers."""
    r = one_rank.run(_opt_stash_case, "dlrm", "table_wise", EBC, False, timeout=TIMEOUT)[0]
    assert r["stopped"], f"no StopIteration after {STEPS} outputs: {r}"
    assert r["outputs"] and r["params"], f"outputs or parameters differ from the plain loop: {r}"
    assert r["state"], "the optimizer state given back differs from the plain loop's"
    assert r["between"] == [0] * STEPS, f"state bytes left between steps: {r['between']}"
    lent = r["seen"]["before_site"][1:] + r["seen"]["after_site"][1:]
    assert lent == [0] * (2 * (STEPS - 1)), f"restored inside backward: {r['seen']}"
