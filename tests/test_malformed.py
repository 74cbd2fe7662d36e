"""A malformed KeyedJaggedTensor on one rank stops every rank with one error naming the batch, the
key and the problem (`check_kjts`, `pipeline.ranks.kjt_check`).

torchrec checks the first batch a sharded module sees and no other: a later
batch whose lengths do not sum to its values, with a negative length, or with an id past its
table's rows fails deep inside input_dist or the lookup on one rank, with the others left in a
collective. On 2 gloo ranks with real all-to-alls (and 3 and 4, with SparseDist, Prefetch and
Lite): rank 1's batch 5 (or 1, which is voted on rather than flagged) is broken one way per case;
every rank raises `MalformedBatchError` before that batch enters a collective, with rank 1's batch,
key and problem in the message, the model is the plain loop's on the batches trained, and the
process group still works. The single-process cases check the messages of rarer shapes (variable batch
per key, weights, a feature in two modules).
"""

from __future__ import annotations

import pytest

from tests.harness import pytest_timeout

PIPELINES = ("TrainPipelineBase", "TrainPipelineSparseDist", "PrefetchTrainPipelineSparseDist")
TIMEOUT = 90
pytestmark = [pytest.mark.timeout(pytest_timeout(TIMEOUT)), pytest.mark.slow]
TRAINED_BEFORE = {
    "TrainPipelineBase": 5,
    "TrainPipelineSparseDist": 4,
    "PrefetchTrainPipelineSparseDist": 4,
    "TrainPipelineSparseDistLite": 5,
}
"""Batches trained before the error when batch 5 is bad (as for wrong keys, tests/test_ranks.py)."""


def _break(batch, how: str):
    """`batch` with its KJT broken on key f1 (the DLRM test model's tables have 40 rows); returns the
    batch and the sample of f1 where it is broken."""
    from torchrec import KeyedJaggedTensor

    kjt = batch.sparse_features
    lengths, values = kjt.lengths().clone(), kjt.values().clone()
    stride = kjt.stride()
    f1 = lengths[stride : 2 * stride]
    sample = int((f1 > 0).nonzero()[0])  # the first sample of f1 with an id
    if how == "negative":
        lengths[stride + sample + 1] += lengths[stride + sample] + 1  # the sum stays right
        lengths[stride + sample] = -1
    elif how == "sum":
        values = values[:-1]
    elif how == "id":
        values[int(lengths[: stride + sample].sum())] = 40
    batch.sparse_features = KeyedJaggedTensor(keys=kjt.keys(), values=values, lengths=lengths)
    return batch, sample


def _malformed(rank: int, world_size: int, pipe_name: str, sharding: str, how: str, at: int) -> dict:
    import torch
    import torch.distributed as dist

    import pipeline
    from tests import models

    data = models.batches("dlrm", 10, rank)
    sample = None
    if rank == 1:
        data[at], sample = _break(data[at], how)
    model, opt = models.build("dlrm", sharding)
    pipe = getattr(pipeline, pipe_name)(model, opt, torch.device("cpu"))
    it, outputs, error = iter(data), [], None
    try:
        while True:
            outputs.append(pipe.progress(it))
    except pipeline.MalformedBatchError as e:
        error = str(e)
    except StopIteration:
        pass
    t = torch.ones(1)
    dist.all_reduce(t)  # nobody was left inside a collective
    ref_model, ref_opt = models.build("dlrm", sharding)
    expected = models.plain_loop(ref_model, ref_opt, data[: len(outputs)])
    plain = models.bitwise_equal(expected, outputs) and models.bitwise_equal(
        ref_model.state_dict(), model.state_dict()
    )
    trained, group_ok = len(outputs), t.item() == world_size
    return {"error": error, "trained": trained, "group_ok": group_ok, "sample": sample, "plain_loop": plain}


PROBLEMS = {
    "negative": "key 'f1': negative length -1 at sample {sample}",
    "sum": "key 'f2': its lengths ask for values",
    "id": "key 'f1': id 40 at sample {sample} is outside the 40 rows of table 't1'",
}
CASES = [(2, "TrainPipelineSparseDist", "table_wise", how, 5) for how in PROBLEMS] + [
    (2, "TrainPipelineBase", "table_wise", "id", 5),
    (2, "PrefetchTrainPipelineSparseDist", "table_wise", "sum", 5),
    (2, "TrainPipelineSparseDist", "column_wise", "id", 5),
    (2, "TrainPipelineSparseDist", "table_wise", "negative", 1),
]
MANY_RANKS = [
    ("TrainPipelineSparseDist", "id"),
    ("PrefetchTrainPipelineSparseDist", "sum"),
    ("TrainPipelineSparseDistLite", "negative"),
]
CASES += [(world, p, "table_wise", how, 5) for world in (3, 4) for p, how in MANY_RANKS]


@pytest.mark.parametrize(("world", "pipe_name", "sharding", "how", "at"), CASES)
def test_a_malformed_kjt_on_one_rank_stops_every_rank_naming_it(pools, world, pipe_name, sharding, how, at):
    results = pools(world).run(_malformed, pipe_name, sharding, how, at, timeout=TIMEOUT)
    problem = PROBLEMS[how].format(sample=results[1]["sample"])
    for rank, r in enumerate(results):
        assert r["error"] is not None, f"rank {rank}: trained every batch, no error"
        where = f"batch {at} of rank 1's dataloader: the KeyedJaggedTensor at batch.sparse_features"
        assert where in r["error"], f"rank {rank}: the error names neither batch nor KJT: {r['error']}"
        assert problem in r["error"], r["error"]
        assert "check_kjts=False" in r["error"], r["error"]
        expected = TRAINED_BEFORE[pipe_name] if at == 5 else TRAINED_BEFORE[pipe_name] - 4
        assert r["trained"] == expected and r["group_ok"], r
        assert r["plain_loop"], f"rank {rank}: not the plain loop's model after {r['trained']} batches"


# -- one process: the messages of rarer shapes ---------------------------------------------------


def _ebc(prefix: str, rows: list[int]):
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    tables = [
        EmbeddingBagConfig(name=f"{prefix}t{i}", embedding_dim=4, num_embeddings=n, feature_names=[f"f{i}"])
        for i, n in enumerate(rows)
    ]
    return EmbeddingBagCollection(tables=tables, device=torch.device("meta"))


def test_check_kjt_names_each_problem_of_a_plain_kjt():
    import torch
    from torchrec import KeyedJaggedTensor

    from pipeline.ranks import KJTCheck

    check = KJTCheck(_ebc("", [40, 40, 50]))
    check.check({})  # the tables are read at the first batch

    def kjt(values, lengths, weights=None):
        return KeyedJaggedTensor(
            keys=["f0", "f1", "f2"],
            values=torch.tensor(values),
            lengths=torch.tensor(lengths),
            weights=None if weights is None else torch.tensor(weights),
        )

    assert check.check_kjt(kjt([1, 2, 3, 39, 45, 49], [1, 1, 1, 1, 1, 1])) is None
    assert check.check_kjt(kjt([1, 2, 3, 40, 5, 6], [1, 1, 1, 1, 1, 1])) == (
        "key 'f1': id 40 at sample 1 is outside the 40 rows of table 't1'"
    )
    assert check.check_kjt(kjt([1, 2, 3, 4, 5, -6], [1, 1, 1, 1, 1, 1])) == (
        "key 'f2': id -6 at sample 1 is outside the 50 rows of table 't2'"
    )
    assert check.check_kjt(kjt([1, 2, 3, 4, 5, 6], [1, 1, -1, 3, 1, 1])) == (
        "key 'f1': negative length -1 at sample 0"
    )
    assert check.check_kjt(kjt([1, 2, 3, 4, 5, 6, 7], [1, 1, 1, 1, 1, 1])) == (
        "key 'f2': the lengths end at value 6, but there are 7 values (the rest belong to no key)"
    )
    assert check.check_kjt(kjt([1, 2, 3], [1, 1, 1, 1, 1, 1])) == (
        "key 'f1': its lengths ask for values 2 to 3, but there are 3 values"
    )
    assert (
        check.check_kjt(kjt([1, 2], [1, 1, 0, 0, 0, 0], [1.0]))
        == "keys ['f0', 'f1', 'f2']: 1 weights for 2 values"
    )
    assert check.check_kjt(kjt([1, 2], [1, 1, 0, 0, 0, 0, 0])) == (
        "keys ['f0', 'f1', 'f2']: 7 lengths do not split into 3 keys of [2, 2, 2] samples"
    )


def test_check_kjt_with_a_variable_batch_per_key_and_keys_without_a_table():
    import torch
    from torchrec import KeyedJaggedTensor

    from pipeline.ranks import KJTCheck

    check = KJTCheck(_ebc("", [40, 40]))
    check.check({})
    kjt = KeyedJaggedTensor(  # f0: 1 sample, f1: 3 samples, f9: no table (any id >= 0 goes)
        keys=["f0", "f1", "f9"],
        values=torch.tensor([1, 2, 3, 41, 10**9]),
        lengths=torch.tensor([1, 1, 1, 1, 1]),
        stride_per_key_per_rank=[[1], [3], [1]],
        inverse_indices=(["f0", "f1", "f9"], torch.zeros(3, 3, dtype=torch.int64)),
    )
    assert check.check_kjt(kjt) == "key 'f1': id 41 at sample 2 is outside the 40 rows of table 't1'"


def test_tables_of_a_feature_in_two_modules_takes_the_larger():
    from torch import nn

    from pipeline.ranks.kjt_check import Table, tables_of

    model = nn.ModuleDict({"a": _ebc("a", [40, 10]), "b": _ebc("b", [30])})
    assert tables_of(model) == {"f0": Table("at0", 40), "f1": Table("at1", 10)}


def test_a_batch_shaped_unlike_the_first_is_still_checked_whole():
    """With `check_keys=False` a batch may hold its KJT elsewhere than the first batch did: the
    check walks it instead of skipping it."""
    import torch
    from torchrec import KeyedJaggedTensor

    from pipeline.ranks import KJTCheck

    def kjt(ids):
        return KeyedJaggedTensor(keys=["f0", "f1"], values=torch.tensor(ids), lengths=torch.tensor([1, 1]))

    check = KJTCheck(_ebc("", [40, 40]))
    assert check.check({"sparse": kjt([1, 2])}) is None
    problem = check.check({"features": kjt([1, 99])})
    assert problem is not None and "id 99" in problem and "at batch['features']" in problem, problem
