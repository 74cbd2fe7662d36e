"""Narrowed ids (`pipeline.stages.narrow`): the input all-to-all sends int32 ids and lengths, and the
numbers stay the plain loop's, bit for bit.

On 2 and 3 gloo ranks, table-, row- and column-wise, unweighted (DLRM, two towers), weighted (a
weighted EBC, and position weights, which row-wise sends with the ids) and the models written as
users write them (tests/user_models.py): each scenario trains with narrowing on and off, and both
give the plain loop's outputs and final parameters; what the KJT all-to-all sent (`_WireSpy`) is
int32 on, int64 off, half the bytes; the batch's KJTs are the dataloader's after the run. A
data-parallel module sends nothing and is left as made.

An id outside int32 (2^32 + 3, in a table of 40 rows): with `check_kjts` every rank stops with the
malformed-batch error naming the id as the dataloader made it; without it the pipeline gives the plain
loop's numbers (fbgemm's bounds check zeroes the id in both), and its twin, a cast without the check,
wraps the id to row 3 and differs. A table of 2^31 rows or more leaves its module's ids as made. The
single-process cases check the copy, the saturation and the option's wiring.
"""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch

from tests.harness import pytest_timeout

STEPS = 8
TIMEOUT = 120
MULTI_RANK = [pytest.mark.timeout(pytest_timeout(TIMEOUT)), pytest.mark.slow]
BAD_ID = 2**32 + 3
"""Wraps to 3 in int32: a valid row of every test table (40 rows)."""


class _WireSpy:
    """Records the dtype and bytes of the lengths and values every KJT values all-to-all sends."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, torch.dtype, int]] = []

    def __enter__(self) -> _WireSpy:
        from unittest import mock

        from torchrec.distributed.dist_data import KJTAllToAllTensorsAwaitable

        original = KJTAllToAllTensorsAwaitable.__init__
        spy = self

        def recording(self, *args, **kwargs):
            labels, tensors = kwargs["labels"], kwargs["input_tensors"]
            for label, tensor in zip(labels, tensors, strict=True):
                if label in ("lengths", "values"):
                    spy.sent.append((label, tensor.dtype, tensor.numel() * tensor.element_size()))
            original(self, *args, **kwargs)

        self._patch = mock.patch.object(KJTAllToAllTensorsAwaitable, "__init__", recording)
        self._patch.start()
        return self

    def __exit__(self, *exc) -> None:
        self._patch.stop()

    def summary(self) -> dict:
        return {
            "dtypes": sorted({str(dtype) for _, dtype, _ in self.sent}),
            "sent": [(label, str(dtype), n) for label, dtype, n in self.sent],
            "count": len(self.sent),
        }


def _snapshot(batches: list) -> list:
    from rewrite import find_kjts

    return [(k.values().clone(), k.lengths().clone()) for b in batches for _, k in find_kjts(b)]


def _unchanged(before: list, batches: list) -> bool:
    from rewrite import find_kjts

    after = [(k.values(), k.lengths()) for b in batches for _, k in find_kjts(b)]
    return len(before) == len(after) and all(
        v.dtype == w.dtype and torch.equal(v, w) and torch.equal(l1, l2)
        for (v, l1), (w, l2) in zip(before, after, strict=True)
    )


def _train(build, batches, *, narrow: bool | None, **options) -> dict:
    """One SparseDist run to the end with narrowing on or off: outputs, state, what went on the
    wire, the report's notes, whether the batches are as made."""
    from unittest import mock

    import pipeline
    from pipeline.stages import narrow as narrowing
    from tests import models

    model, opt = build()
    data = batches()
    before = _snapshot(data)
    passes = mock.patch.object(narrowing, "_to_int32", side_effect=narrowing._to_int32)
    with _WireSpy() as spy, passes as own_pass:
        pipe = pipeline.TrainPipelineSparseDist(
            model,
            opt,
            torch.device("cpu"),
            input_dist=pipeline.InputDistOptions(narrow_ids=narrow),
            ranks=pipeline.RankOptions(**options),
        )
        outputs = models.run_to_end(pipe, iter(data))
    return {
        "own_passes": own_pass.call_count,
        "outputs": outputs,
        "state": models.flat_tensors(model.state_dict()),
        "wire": spy.summary(),
        "notes": list(pipe.rewrite_report.notes),
        "unchanged": _unchanged(before, data),
    }


def _compare(expected: list, ref_state: list, runs: dict) -> dict:
    from tests import models

    return {
        narrow: {
            "outputs": models.bitwise_equal(expected, run["outputs"]),
            "params": models.bitwise_equal(ref_state, run["state"]),
            "count": len(run["outputs"]),
            **{k: run[k] for k in ("wire", "notes", "unchanged", "own_passes")},
        }
        for narrow, run in runs.items()
    }


def _model_case(rank: int, world_size: int, kind: str, sharding: str) -> dict:
    from tests import models

    expected, ref_state = models.reference(kind, sharding, STEPS, rank)
    runs = {
        narrow: _train(
            lambda: models.build(kind, sharding), lambda: models.batches(kind, STEPS, rank), narrow=narrow
        )
        for narrow in (True, False)
    }
    return _compare(expected, ref_state, runs)


def _user_case(rank: int, world_size: int, pattern: str) -> dict:
    from tests import models, user_models

    ref, ref_opt = user_models.build(pattern)
    expected = models.plain_loop(ref, ref_opt, user_models.batches(STEPS, rank))
    runs = {
        narrow: _train(
            lambda: user_models.build(pattern), lambda: user_models.batches(STEPS, rank), narrow=narrow
        )
        for narrow in (True, False)
    }
    return _compare(expected, models.flat_tensors(ref.state_dict()), runs)


def _assert_narrowed(
    results: list, where: str, *, recorded: bool = False, steps: int = STEPS, checked: bool = False
) -> None:
    """Both runs of each rank give the plain loop's numbers and leave the batches as made; with
    narrowing every KJT all-to-all sent int32 (but the recorded first batch's, which the model's
    own forward sends: `recorded`), half the bytes of the same all-to-all without it. `checked`:
    each module takes a KJT of the batch itself, so the narrowing makes no pass of its own."""
    for rank, r in enumerate(results):
        for narrow, run in r.items():
            at = f"{where}, narrow_ids={narrow}, rank {rank}"
            assert run["count"] == steps, f"{at}: {run['count']} outputs"
            assert run["outputs"], f"{at}: outputs differ from the plain loop"
            assert run["params"], f"{at}: final parameters differ from the plain loop"
            assert run["unchanged"], f"{at}: the batch's KJTs changed"
            assert run["wire"]["count"] > 0, f"{at}: no KJT all-to-all seen"
        on, off = r[True]["wire"]["sent"], r[False]["wire"]["sent"]
        head = next((i for i, (_, dtype, _) in enumerate(on) if dtype != "torch.int64"), len(on))
        assert (head > 0) == recorded, f"{where}, rank {rank}: {head} int64 sends before the first int32"
        assert on[:head] == off[:head] and len(on) == len(off), f"{where}, rank {rank}: {on} vs {off}"
        assert {dtype for _, dtype, _ in on[head:]} == {"torch.int32"}, f"{where}, rank {rank}: sent {on}"
        assert {dtype for _, dtype, _ in off} == {"torch.int64"}, (
            f"{where}, rank {rank}: not narrowed, sent {off}"
        )
        halves = [(label, 2 * n) for label, _, n in on[head:]]
        assert halves == [(label, n) for label, _, n in off[head:]], f"{where}, rank {rank}: {on} vs {off}"
        assert any("sent as int32" in n for n in r[True]["notes"]), r[True]["notes"]
        assert any("narrow_ids=False" in n for n in r[False]["notes"]), r[False]["notes"]
        if checked:  # the batch's own KJTs, passed by the malformed-batch check: its pass serves
            assert r[True]["own_passes"] == 0, f"{where}, rank {rank}: {r[True]['own_passes']} own passes"


MODEL_CASES = [
    (2, "dlrm", "table_wise"),
    (2, "weighted", "row_wise"),
    (2, "fp", "row_wise"),
    (2, "dict", "column_wise"),
    (3, "weighted", "table_wise"),
    (3, "nested", "row_wise"),
    (3, "dlrm", "column_wise"),
]
"""(world size, kind, sharding), 2 ranks first: the module holds one pool at a time."""


@pytest.mark.parametrize(("world", "kind", "sharding"), MODEL_CASES)
@pytest.mark.timeout(pytest_timeout(TIMEOUT))
@pytest.mark.slow
def test_narrowed_ids_give_the_plain_loops_numbers_and_half_the_bytes(pools, world, kind, sharding):
    results = pools(world).run(_model_case, kind, sharding, timeout=TIMEOUT)
    _assert_narrowed(results, f"{kind} {sharding} at {world} ranks", checked=True)


USER_CASES = [(2, "split"), (2, "built"), (2, "shared"), (2, "recorded"), (3, "shared")]


@pytest.mark.parametrize(("world", "pattern"), USER_CASES)
@pytest.mark.timeout(pytest_timeout(TIMEOUT))
@pytest.mark.slow
def test_narrowed_ids_on_models_written_as_users_write_them(pools, world, pattern):
    results = pools(world).run(_user_case, pattern, timeout=TIMEOUT)
    _assert_narrowed(results, f"the {pattern!r} user model at {world} ranks", recorded=pattern == "recorded")


@pytest.mark.timeout(pytest_timeout(TIMEOUT))
@pytest.mark.slow
def test_a_data_parallel_module_sends_nothing_and_is_left_as_made(pools):
    for rank, r in enumerate(pools(2).run(_model_case, "weighted", "data_parallel", timeout=TIMEOUT)):
        for narrow, run in r.items():
            at = f"data-parallel, narrow_ids={narrow}, rank {rank}"
            assert run["outputs"] and run["params"], f"{at}: not the plain loop's numbers"
            assert run["wire"]["count"] == 0, f"{at}: a KJT all-to-all ran: {run['wire']}"
        assert any("data-parallel" in n for n in r[True]["notes"]), r[True]["notes"]


# -- the default: narrowed where the ranks send enough ids ------------------------------------------


def _default_case(rank: int, world_size: int, narrow_from: int) -> dict:
    from unittest import mock

    from tests import models

    expected, ref_state = models.reference("dlrm", "table_wise", STEPS, rank)
    build, batches = lambda: models.build("dlrm", "table_wise"), lambda: models.batches("dlrm", STEPS, rank)
    with mock.patch("pipeline.stages.narrow.NARROW_FROM", narrow_from):
        run = _train(build, batches, narrow=None)
    equal = models.bitwise_equal(expected, run["outputs"]) and models.bitwise_equal(ref_state, run["state"])
    return {
        "equal": equal,
        "dtypes": run["wire"]["dtypes"],
        "notes": run["notes"],
    }


@pytest.mark.timeout(pytest_timeout(TIMEOUT))
@pytest.mark.slow
def test_the_default_narrows_only_where_the_ranks_send_enough_ids(pools):
    """At the default, the same model is narrowed with a threshold below its batches' ids and sent
    as made above it, the report saying why; both give the plain loop's numbers."""
    for narrow_from, dtypes in ((1, ["torch.int32"]), (10**9, ["torch.int64"])):
        for rank, r in enumerate(pools(2).run(_default_case, narrow_from, timeout=TIMEOUT)):
            at = f"NARROW_FROM={narrow_from}, rank {rank}"
            assert r["equal"], f"{at}: not the plain loop's numbers"
            assert r["dtypes"] == dtypes, f"{at}: sent {r['dtypes']}"
            said = [n for n in r["notes"] if "ids a rank a batch, below" in n]
            assert bool(said) == (narrow_from > 1), f"{at}: {r['notes']}"


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.timeout(pytest_timeout(TIMEOUT))
@pytest.mark.slow
def test_ranks_whose_counts_straddle_the_threshold_send_alike(pools, world):
    """At 3 and 4 ranks, a threshold between the ranks' own counts of ids in the first batch: each
    rank alone would decide apart (int32 against int64 on one all-to-all); on the exchanged counts
    every rank narrows where their mean reaches it and none does where it falls short."""
    from tests import models

    counts = [
        models.batches("dlrm", STEPS, rank)[0].sparse_features.values().numel() for rank in range(world)
    ]
    mean = sum(counts) / world
    for narrow_from, dtypes in ((mean, ["torch.int32"]), (mean + 0.01, ["torch.int64"])):
        assert min(counts) < narrow_from <= max(counts), f"no straddle: {counts}, {narrow_from}"
        for rank, r in enumerate(pools(world).run(_default_case, narrow_from, timeout=TIMEOUT)):
            at = f"{world} ranks, counts {counts}, NARROW_FROM={narrow_from}, rank {rank}"
            assert r["equal"], f"{at}: not the plain loop's numbers"
            assert r["dtypes"] == dtypes, f"{at}: sent {r['dtypes']}"


def test_the_default_decides_on_every_ranks_count_not_its_own(monkeypatch):
    """Two simulated ranks whose first batches straddle the threshold: deciding on the exchanged
    counts, both narrow (their mean is above it); the twin, each deciding on its own count, splits
    them, which on real ranks would send int32 against int64."""
    from types import SimpleNamespace

    from pipeline.stages import narrow

    monkeypatch.setattr(narrow, "decide", lambda module: None)
    monkeypatch.setattr(narrow, "NARROW_FROM", 100)
    site = SimpleNamespace(key="ebc", module=None)
    samples = [[(site, [_kjt([1] * 40, [20, 20])], {})], [(site, [_kjt([1] * 200, [100, 100])], {})]]
    counts = [[40], [200]]

    def sites(gather) -> list[frozenset]:
        decided = []
        for sample in samples:
            ids = narrow.NarrowIds(None, lambda text: None)
            ids.settle([site], lambda sample=sample: sample, gather)
            decided.append(ids.sites)
        return decided

    assert sites(lambda mine: counts) == [{"ebc"}, {"ebc"}]
    assert sites(lambda mine: [mine]) == [frozenset(), {"ebc"}], "the twin: each rank on its own count"


# -- an id outside int32 ---------------------------------------------------------------------------


def _with_bad_id(data: list, at: int) -> None:
    """Batch `at` of `data` with its first id of f1 replaced by BAD_ID (in place)."""
    from torchrec import KeyedJaggedTensor

    kjt = data[at].sparse_features
    values, lengths = kjt.values().clone(), kjt.lengths()
    stride = kjt.stride()
    first_of_f1 = int(lengths[:stride].sum())
    assert int(lengths[stride:].sum()) > 0
    values[first_of_f1] = BAD_ID
    data[at].sparse_features = KeyedJaggedTensor(keys=kjt.keys(), values=values, lengths=lengths)


def _bad_id_case(rank: int, world_size: int, check: bool, wrap: bool) -> dict:
    import contextlib
    from unittest import mock

    import pipeline
    from tests import models

    def batches():
        data = models.batches("dlrm", STEPS, rank)
        if rank == 1:
            _with_bad_id(data, 3)
        return data

    def plain_cast(tensor):  # the twin: narrowing without the check
        return tensor.to(torch.int32), False

    ref, ref_opt = models.build("dlrm", "table_wise")
    expected = models.plain_loop(ref, ref_opt, batches())
    twin = mock.patch("pipeline.stages.narrow._to_int32", plain_cast) if wrap else contextlib.nullcontext()
    try:
        with twin:
            run = _train(lambda: models.build("dlrm", "table_wise"), batches, narrow=True, check_kjts=check)
    except pipeline.MalformedBatchError as e:
        return {"error": str(e)}
    return {
        "error": None,
        "equal": models.bitwise_equal(expected, run["outputs"])
        and models.bitwise_equal(models.flat_tensors(ref.state_dict()), run["state"]),
        "wire": run["wire"],
        "notes": run["notes"],
    }


@pytest.mark.timeout(pytest_timeout(TIMEOUT))
@pytest.mark.slow
def test_an_id_outside_int32_is_caught_by_the_kjt_check_as_made(pools):
    for rank, r in enumerate(pools(2).run(_bad_id_case, True, False, timeout=TIMEOUT)):
        assert r["error"] is not None, f"rank {rank}: trained through an id of {BAD_ID}"
        assert f"id {BAD_ID} at sample" in r["error"], f"rank {rank}: {r['error']}"


@pytest.mark.parametrize("wrap", [False, True], ids=["checked", "twin-plain-cast"])
@pytest.mark.timeout(pytest_timeout(TIMEOUT))
@pytest.mark.slow
def test_an_id_outside_int32_is_never_wrapped_to_a_valid_row(pools, wrap):
    results = pools(2).run(_bad_id_case, False, wrap, timeout=TIMEOUT)
    for rank, r in enumerate(results):
        assert r["error"] is None, f"rank {rank}: {r['error']}"
        assert r["wire"]["dtypes"] == ["torch.int32"], r["wire"]
    if wrap:  # the twin: a plain cast reads row 3 where the plain loop's bounds check reads none
        assert not all(r["equal"] for r in results), "a wrapped id gave the plain loop's numbers"
        return
    assert all(r["equal"] for r in results), "the saturated id did not give the plain loop's numbers"
    assert any("outside int32" in n for n in results[1]["notes"]), results[1]["notes"]


def _big_table_case(rank: int, world_size: int) -> dict:
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    from tests import models

    def build():
        model, opt = models.build("dlrm", "table_wise")
        for module in model.modules():
            if isinstance(module, ShardedEmbeddingBagCollection):
                module._embedding_bag_configs[0].num_embeddings = 2**31  # as the sharding read 40
        return model, opt

    expected, ref_state = models.reference("dlrm", "table_wise", STEPS, rank)
    run = _train(build, lambda: models.batches("dlrm", STEPS, rank), narrow=True)
    return {
        "equal": models.bitwise_equal(expected, run["outputs"])
        and models.bitwise_equal(ref_state, run["state"]),
        "wire": run["wire"],
        "notes": run["notes"],
    }


@pytest.mark.timeout(pytest_timeout(TIMEOUT))
@pytest.mark.slow
def test_a_table_of_2_31_rows_leaves_its_modules_ids_as_made(pools):
    for rank, r in enumerate(pools(2).run(_big_table_case, timeout=TIMEOUT)):
        assert r["equal"], f"rank {rank}: not the plain loop's numbers"
        assert r["wire"]["dtypes"] == ["torch.int64"], f"rank {rank}: sent {r['wire']['dtypes']}"
        assert any("2147483648 rows" in n for n in r["notes"]), r["notes"]


# -- the plan's kernels, and what a receiver sums ---------------------------------------------------


def _kernel_case(rank: int, world_size: int, twin: bool) -> dict:
    """The plan puts one table on a kernel not known to widen int32 ids ("fused_triton"), the
    kernels built being torchrec's CPU ones as before: every rank keeps that module's ids int64.
    `twin`: the kernels looked for among the module's children, as before (never found there)."""
    from unittest import mock

    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    from pipeline.stages import narrow
    from tests import models

    def build():
        model, opt = models.build("dlrm", "table_wise")
        for module in model.modules():
            if isinstance(module, ShardedEmbeddingBagCollection):
                first = sorted(module.module_sharding_plan)[0]
                module.module_sharding_plan[first].compute_kernel = "fused_triton"
        return model, opt

    def children(module):  # the twin: the module's children searched for kernels
        return None if isinstance(module, narrow._MODULES) else "not a collection"

    expected, ref_state = models.reference("dlrm", "table_wise", STEPS, rank)
    with mock.patch.object(narrow, "decide", children) if twin else contextlib.nullcontext():
        run = _train(build, lambda: models.batches("dlrm", STEPS, rank), narrow=True)
    return {
        "equal": models.bitwise_equal(expected, run["outputs"])
        and models.bitwise_equal(ref_state, run["state"]),
        "dtypes": run["wire"]["dtypes"],
        "notes": run["notes"],
    }


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("twin", [False, True], ids=["plan", "twin-children"])
@pytest.mark.timeout(pytest_timeout(TIMEOUT))
@pytest.mark.slow
def test_a_kernel_the_plan_does_not_know_to_widen_keeps_64_bit_ids_on_every_rank(pools, world, twin):
    results = pools(world).run(_kernel_case, twin, timeout=TIMEOUT)
    for rank, r in enumerate(results):
        assert r["equal"], f"rank {rank}: not the plain loop's numbers"
        if twin:
            assert r["dtypes"] == ["torch.int32"], f"the twin narrows regardless: {r['dtypes']}"
            continue
        assert r["dtypes"] == ["torch.int64"], f"rank {rank}: sent {r['dtypes']}"
        assert any("'fused_triton' kernel, not one known to widen" in n for n in r["notes"]), r["notes"]


LIMIT = 30
"""The receivers' limit in `_received_case` (what a receiver gets there: 28-43 ids a batch on rank
0, 15-23 on rank 1)."""


def _received_case(rank: int, world_size: int, twin: bool) -> dict:
    """Narrowed ids, with the receivers' limit lowered to 30 ids (2^31 in earnest): every values
    all-to-all that received more keeps its lengths int64 before torchrec sums them. What reaches
    `KeyedJaggedTensor.dist_init` (the receiver's reordering) is recorded. `twin`: no widening."""
    from unittest import mock

    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from pipeline.stages import input_dist, narrow
    from tests import models

    original = KeyedJaggedTensor.dist_init
    seen: list[tuple[str, int]] = []

    def recording(keys, tensors, *args, **kwargs):
        seen.append((str(tensors[0].dtype), tensors[1].numel()))
        return original(keys, tensors, *args, **kwargs)

    expected, ref_state = models.reference("dlrm", "table_wise", STEPS, rank)
    with contextlib.ExitStack() as patched:
        patched.enter_context(mock.patch.object(narrow, "RECEIVED_LIMIT", LIMIT))
        patched.enter_context(mock.patch.object(KeyedJaggedTensor, "dist_init", staticmethod(recording)))
        if twin:
            patched.enter_context(mock.patch.object(input_dist, "widen_received", lambda request: request))
        run = _train(
            lambda: models.build("dlrm", "table_wise"),
            lambda: models.batches("dlrm", STEPS, rank),
            narrow=True,
        )
    return {
        "equal": models.bitwise_equal(expected, run["outputs"])
        and models.bitwise_equal(ref_state, run["state"]),
        "wire": run["wire"]["dtypes"],
        "received": seen,
    }


@pytest.mark.parametrize("twin", [False, True], ids=["widened", "twin-int32-sum"])
@pytest.mark.timeout(pytest_timeout(TIMEOUT))
@pytest.mark.slow
def test_lengths_a_receiver_would_sum_past_its_limit_stay_64_bit(pools, twin):
    results = pools(2).run(_received_case, twin, timeout=TIMEOUT)
    received = [x for r in results for x in r["received"]]
    for rank, r in enumerate(results):
        assert r["equal"] and r["wire"] == ["torch.int32"], f"rank {rank}: {r}"
    over = {dtype for dtype, ids in received if ids >= LIMIT}
    under = {dtype for dtype, ids in received if ids < LIMIT}
    assert over and under, f"the limit splits nothing: {received}"
    assert over == {"torch.int32" if twin else "torch.int64"}, received
    assert under == {"torch.int32"}, f"widened under the limit: {received}"


def _garbage_case(rank: int, world_size: int, twin: bool) -> dict:
    """Narrowed ids trained to the end with the cyclic collector off: what it then finds unreachable
    (kept in `gc.garbage` by DEBUG_SAVEALL). `twin`: the receivers' wait wrapper stays on its
    awaitable (a reference cycle through it, which held every batch's received tensors until the
    collector's next full pass: over 1 Gbit on net-ids120, the peak resident set grew 3 times
    torchrec's)."""
    import gc
    from unittest import mock

    from torchrec.distributed.dist_data import KJTAllToAllTensorsAwaitable

    import pipeline
    from pipeline.stages import narrow
    from tests import models

    model, opt = models.build("dlrm", "table_wise")
    data = models.batches("dlrm", STEPS, rank)
    with contextlib.ExitStack() as patched:
        if twin:
            patched.enter_context(mock.patch.object(narrow, "_widened_wait", lambda inner, wait: wait()))
        gc.collect()
        gc.disable()
        try:
            pipe = pipeline.TrainPipelineSparseDist(
                model, opt, torch.device("cpu"), input_dist=pipeline.InputDistOptions(narrow_ids=True)
            )
            outputs = models.run_to_end(pipe, iter(data))
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            found = {
                "awaitables": sum(isinstance(o, KJTAllToAllTensorsAwaitable) for o in gc.garbage),
                "tensors": sum(isinstance(o, torch.Tensor) for o in gc.garbage),
            }
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
    return {"count": len(outputs), **found}


@pytest.mark.parametrize("twin", [False, True], ids=["released", "twin-cycle"])
@pytest.mark.timeout(pytest_timeout(TIMEOUT))
@pytest.mark.slow
def test_what_a_narrowed_batch_received_is_freed_without_the_cyclic_collector(pools, twin):
    for rank, r in enumerate(pools(2).run(_garbage_case, twin, timeout=TIMEOUT)):
        assert r["count"] == STEPS, f"rank {rank}: {r}"
        if twin:
            assert r["awaitables"] > 0 and r["tensors"] > 0, f"rank {rank}: the twin left no cycle: {r}"
        else:
            assert r["awaitables"] == r["tensors"] == 0, f"rank {rank}: left to the collector: {r}"


def test_an_int32_running_sum_of_lengths_wraps_past_2_31():
    """Why a receiver widens: the offsets of lengths 2^30, 2^30, 2^30 in int32 wrap."""
    lengths = torch.tensor([2**30] * 3, dtype=torch.int32)
    assert torch.ops.fbgemm.asynchronous_complete_cumsum(lengths).tolist() == [0, 2**30, -(2**31), -(2**30)]
    assert torch.ops.fbgemm.asynchronous_complete_cumsum(lengths.long()).tolist()[-1] == 3 * 2**30


# -- one process ---------------------------------------------------------------------------------


def _kjt(values, lengths, *, f: bool = False, **kwargs):
    """Keys a and b; with `f`, f0 and f1 (the features of `test_malformed._ebc`'s tables)."""
    from torchrec import KeyedJaggedTensor

    keys = ["f0", "f1"] if f else ["a", "b"]
    return KeyedJaggedTensor(keys=keys, values=torch.tensor(values), lengths=torch.tensor(lengths), **kwargs)


def test_narrow_kjt_copies_ids_and_lengths_as_int32_and_keeps_the_rest():
    from pipeline.stages.narrow import narrow_kjt

    weights = torch.rand(4)
    kjt = _kjt([5, 0, 7, 39], [1, 2, 1, 0], weights=weights)
    narrowed = narrow_kjt(kjt)
    copy = narrowed.kjt
    assert copy is not kjt and not narrowed.saturated
    assert copy.values().dtype == copy.lengths().dtype == torch.int32
    assert copy.values().tolist() == [5, 0, 7, 39] and copy.lengths().tolist() == [1, 2, 1, 0]
    assert copy.weights() is weights and copy.keys() == kjt.keys() and copy.stride() == kjt.stride()
    assert kjt.values().dtype == kjt.lengths().dtype == torch.int64  # the batch's own is untouched
    int32 = _kjt([1, 2], [1, 1, 0, 0])
    int32 = type(int32)(keys=["a", "b"], values=int32.values().int(), lengths=int32.lengths().int())
    assert narrow_kjt(int32).kjt is int32  # nothing to narrow: the same object


def test_narrow_kjt_keeps_a_variable_batch_per_key():
    from pipeline.stages.narrow import narrow_kjt

    inverse = (["a", "b"], torch.zeros(2, 3, dtype=torch.int64))
    kjt = _kjt([1, 2, 3, 4], [1, 1, 2], stride_per_key_per_rank=[[1], [2]], inverse_indices=inverse)
    copy = narrow_kjt(kjt).kjt
    assert copy.variable_stride_per_key() and copy.stride_per_key_per_rank() == [[1], [2]]
    assert copy.inverse_indices() is inverse and copy.values().dtype == torch.int32


def test_a_kjt_the_check_passed_is_cast_without_a_pass_of_its_own(monkeypatch):
    from pipeline.ranks import KJTCheck
    from pipeline.stages import narrow
    from tests.test_malformed import _ebc

    check = KJTCheck(_ebc("", [40, 40]))
    check.check({})  # the tables are read at the first batch
    good, bad = _kjt([5, 0, 7, 39], [1, 2, 1, 0], f=True), _kjt([5, 0, 7, 40], [1, 2, 1, 0], f=True)
    assert check.check_kjt(good) is None and check.check_kjt(bad) is not None
    proven = check.in_int32
    assert good.values() in proven and good.lengths() in proven
    assert bad.values() not in proven and good.values().clone() not in proven  # by identity
    calls = []
    monkeypatch.setattr(narrow, "_to_int32", lambda t: calls.append(t) or (t.to(torch.int32), False))
    copy = narrow.narrow_kjt(good, proven).kjt
    assert calls == [] and copy.values().tolist() == [5, 0, 7, 39] and copy.values().dtype == torch.int32
    narrow.narrow_kjt(bad, proven)
    assert len(calls) == 2, "a KJT the check did not pass is narrowed with its own pass"


def test_the_checks_proof_is_not_given_where_a_table_could_hold_larger_ids():
    import gc

    from torchrec import KeyedJaggedTensor

    from pipeline.ranks import KJTCheck
    from tests.test_malformed import _ebc

    check = KJTCheck(_ebc("", [40, 2**31 + 1]))
    check.check({})
    big = _kjt([5, 0, 7, 39], [1, 2, 1, 0], f=True)
    assert check.check_kjt(big) is None and big.values() not in check.in_int32
    # a feature without a table (f9) leaves the proof to its ids alone: in int32 here, so proven
    without_table = KeyedJaggedTensor(keys=["f0", "f9"], values=big.values(), lengths=big.lengths())
    assert check.check_kjt(without_table) is None and big.values() in check.in_int32
    assert check.untabled == {"f9"}
    past = KeyedJaggedTensor(
        keys=["f0", "f9"], values=torch.tensor([5, 2**31 + 7]), lengths=torch.tensor([1, 1])
    )
    assert check.check_kjt(past) is None and past.values() not in check.in_int32  # no table: no error
    bad = KeyedJaggedTensor(keys=["f0", "f9"], values=torch.tensor([40, 1]), lengths=torch.tensor([1, 1]))
    assert "id 40 at sample 0 is outside the 40 rows" in check.check_kjt(bad)
    small = KJTCheck(_ebc("", [40, 40]))
    small.check({})
    kjt = KeyedJaggedTensor(keys=["f0", "f1"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))
    assert small.check_kjt(kjt) is None and kjt.values() in small.in_int32
    del kjt
    gc.collect()
    assert not small.in_int32._tensors, "a dead tensor's proof was kept (its id may be reused)"


@pytest.mark.parametrize("wrap", [False, True], ids=["checked", "twin-plain-cast"])
def test_an_id_outside_int32_saturates_outside_every_table(wrap, monkeypatch):
    from pipeline.stages import narrow

    if wrap:  # the twin: the cast without the check
        monkeypatch.setattr(narrow, "_to_int32", lambda t: (t.to(torch.int32), False))
    narrowed = narrow.narrow_kjt(_kjt([1, BAD_ID, -(2**40), 2], [1, 1, 1, 1]))
    ids = narrowed.kjt.values().tolist()
    rows = 40
    outside = [i for i in ids[1:3] if not 0 <= i < rows]
    if wrap:
        assert ids[1] == 3 and len(outside) < 2  # wrapped into the table: what the check prevents
        return
    assert narrowed.saturated and ids == [1, 2**31 - 1, -(2**31), 2]
    assert len(outside) == 2, f"a bad id landed on a valid row: {ids}"


def test_decide_names_what_is_not_narrowed():
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    from pipeline.stages.narrow import decide

    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])],
        device=torch.device("meta"),
    )
    assert "EmbeddingBagCollection" in decide(ebc)  # only sharded collections are known to widen


def _classes_with_input_dist() -> list[str]:
    import pipeline

    return sorted(
        n
        for n in pipeline.__all__
        if inspect.isclass(c := getattr(pipeline, n))
        and (issubclass(c, pipeline.TrainPipelineSparseDist) or c is pipeline.SparseDataDistUtil)
    )


@pytest.mark.parametrize("name", _classes_with_input_dist())
def test_every_class_that_runs_an_input_dist_takes_narrow_ids(name):
    """Through `input_dist=InputDistOptions(narrow_ids=...)`, the one way to pass it."""
    import pipeline

    parameter = inspect.signature(getattr(pipeline, name)).parameters.get("input_dist")
    assert parameter is not None, f"{name} has no input_dist keyword (InputDistOptions.narrow_ids)"
    assert parameter.kind is inspect.Parameter.KEYWORD_ONLY and parameter.default is None


def test_narrow_ids_reaches_the_pipeline_through_its_options_object():
    import pipeline
    from pipeline.options import InputDistOptions
    from tests.test_torchrec_parity import _Echo

    assert InputDistOptions().narrow_ids is None  # the default: where the batches are large enough
    with pytest.raises(ValueError, match="narrow_ids must be one of"):
        InputDistOptions(narrow_ids="yes")

    def options(**kwargs):
        model = _Echo()
        pipe = pipeline.TrainPipelineSparseDist(
            model, torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"), **kwargs
        )
        return pipe._input_dist._narrow._enabled

    assert options() is None
    assert options(input_dist=InputDistOptions(narrow_ids=True)) is True
    assert options(input_dist=InputDistOptions(narrow_ids=False)) is False
    with pytest.raises(TypeError, match="unexpected keyword"):  # one way in: the options object
        options(narrow_ids=True)
