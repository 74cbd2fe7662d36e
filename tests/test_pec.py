"""TrainPipelinePEC against the plain loop, bit for bit, on 2 gloo ranks with distinct batches.

- an ordinary model (tests/user_models.py "split": table-wise and column-wise tables in one model):
  the plain loop's outputs and parameters, one output per batch, then StopIteration; a twin with
  one optimizer step skipped differs.
- a model with a PEC embedding collection (row-wise, as its sharder requires) beside a table-wise
  and a column-wise table: the plain loop's numbers, and the rewrite report says that PEC's split of
  the ids is not done. torchrec 1.8 and 1.9 both ship the PEC modules; torchrec's own
  TrainPipelinePEC (1.9 only) needs CUDA, so it is not run here.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import pytest
import torch
from torchrec import KeyedJaggedTensor

from tests.harness import pytest_timeout

STEPS = 6
TIMEOUT = 150
pytestmark = [pytest.mark.timeout(pytest_timeout(TIMEOUT)), pytest.mark.slow]


@dataclass
class PecBatch:
    """Dense features, a KJT for the bag tables (ff0, ff1), a KJT for the PEC table (p0), labels."""

    dense: torch.Tensor
    bags: KeyedJaggedTensor
    seq: KeyedJaggedTensor
    labels: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> PecBatch:
        return PecBatch(*(getattr(self, f).to(device=device, non_blocking=non_blocking) for f in _FIELDS))


_FIELDS = ("dense", "bags", "seq", "labels")


class PecModel(torch.nn.Module):
    """Pooled bags of f0 (table-wise) and f1 (column-wise), plus the summed sequence embeddings of
    p0 (a PEC collection, row-wise), into a linear head and a binary cross-entropy loss."""

    def __init__(self) -> None:
        from torchrec import EmbeddingBagCollection, EmbeddingCollection, EmbeddingConfig
        from torchrec.modules.pec_embedding_modules import PECEmbeddingCollection

        from tests.models import DENSE, DIM, ROWS, tables

        super().__init__()
        cpu = torch.device("cpu")
        self.ebc = EmbeddingBagCollection(tables=tables("f", 2), device=cpu)
        config = EmbeddingConfig(name="p_table", feature_names=["p0"], embedding_dim=DIM, num_embeddings=ROWS)
        self.pec = PECEmbeddingCollection(EmbeddingCollection(tables=[config], device=cpu))
        self.head = torch.nn.Linear(DENSE + 3 * DIM, 1)

    def forward(self, batch: PecBatch) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = self.ebc(batch.bags).values()
        seq = self.pec(batch.seq)["p0"]
        lengths = seq.lengths()
        bag = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        summed = torch.zeros(lengths.numel(), seq.values().shape[1]).index_add(0, bag, seq.values())
        logits = self.head(torch.cat([batch.dense, pooled, summed], dim=1)).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, logits.detach()


def build_pec(seed: int = 0):
    """The PEC model sharded over 2 ranks: f0 table-wise, f1 column-wise, p0 row-wise."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.pec_embedding import PECEmbeddingCollectionSharder
    from torchrec.distributed.sharding_plan import (
        column_wise,
        construct_module_sharding_plan,
        row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    torch.manual_seed(seed)
    model = PecModel()
    for module in (model.ebc, model.pec):
        apply_optimizer_in_backward(torch.optim.SGD, module.parameters(), {"lr": 0.5})
    sharders = [EmbeddingBagCollectionSharder(), PECEmbeddingCollectionSharder()]
    names = [t.name for t in model.ebc.embedding_bag_configs()]
    per_table = {names[0]: table_wise(rank=0), names[1]: column_wise(ranks=[0, 1])}
    plan = ShardingPlan(
        {
            "ebc": construct_module_sharding_plan(
                model.ebc, per_table, local_size=2, world_size=2, device_type="cpu"
            ),
            "pec": construct_module_sharding_plan(
                model.pec,
                {"p_table": row_wise()},
                sharder=sharders[1],
                local_size=2,
                world_size=2,
                device_type="cpu",
            ),
        }
    )
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    return dmp, KeyedOptimizerWrapper(dense, lambda params: torch.optim.SGD(params, lr=0.1))


def pec_batches(n: int, rank: int, seed: int = 4) -> list[PecBatch]:
    """`n` distinct batches for `rank`."""
    from tests.models import BATCH, DENSE, MAX_BAG, ROWS

    gen = torch.Generator().manual_seed(seed * 1000 + rank)

    def kjt(keys: list[str]) -> KeyedJaggedTensor:
        lengths = torch.randint(0, MAX_BAG + 1, (len(keys) * BATCH,), generator=gen)
        values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=gen)
        return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)

    return [
        PecBatch(
            dense=torch.rand(BATCH, DENSE, generator=gen),
            bags=kjt(["ff0", "ff1"]),
            seq=kjt(["p0"]),
            labels=torch.randint(0, 2, (BATCH,), generator=gen).float(),
        )
        for _ in range(n)
    ]


def _case(rank: int, world_size: int, kind: str) -> dict:
    import pipeline
    from tests import models, user_models

    if kind == "ordinary":
        build, data = (lambda: user_models.build("split")), user_models.batches(STEPS, rank)
    else:
        build, data = build_pec, pec_batches(STEPS, rank)
    ref_model, ref_opt = build()
    expected = models.plain_loop(ref_model, ref_opt, data)
    twin_model, twin_opt = build()
    models.plain_loop(twin_model, twin_opt, data[:-1])
    model, opt = build()
    pipe = pipeline.TrainPipelinePEC(model, opt, torch.device("cpu"))
    outputs, stopped = models.outputs_then_stop(pipe, iter(data), STEPS)
    return {
        "outputs": models.bitwise_equal(expected, outputs),
        "params": models.bitwise_equal(ref_model.state_dict(), model.state_dict()),
        "twin_differs": not models.bitwise_equal(twin_model.state_dict(), model.state_dict()),
        "count": len(outputs),
        "stopped": stopped,
        "pec": pipeline.pipelines.lookups.pec_modules(model),
        "notes": list(pipe.rewrite_report.notes),
        "not_pipelined": [m.fqn for m in pipe.rewrite_report.not_pipelined],
    }


@pytest.mark.parametrize("kind", ["ordinary", "with_pec"])
def test_pec_pipeline_equals_plain_loop(pool, kind):
    for rank, r in enumerate(pool.run(_case, kind, timeout=TIMEOUT)):
        assert r["not_pipelined"] == [], (
            f"{kind}: rank {rank}: modules left unpipelined: {r['not_pipelined']}"
        )
        assert r["count"] == STEPS and r["stopped"], f"{kind}: rank {rank}: {r['count']} outputs, then no end"
        assert r["outputs"], f"{kind}: rank {rank}: per-step outputs differ from the plain loop"
        assert r["params"], f"{kind}: rank {rank}: final parameters differ from the plain loop"
        assert r["twin_differs"], f"{kind}: rank {rank}: a skipped optimizer step would go unnoticed"
        says_so = any("PEC modules" in n and "not implemented" in n for n in r["notes"])
        if kind == "with_pec":
            assert [fqn.rsplit(".", 1)[-1] for fqn in r["pec"]] == ["pec"], (
                f"rank {rank}: PEC module not found: {r}"
            )
            assert says_so, f"rank {rank}: the report does not say PEC's split is not done: {r['notes']}"
        else:
            assert r["pec"] == [] and not says_so, f"rank {rank}: a PEC note on a model without PEC: {r}"


def test_signature_is_torchrecs():
    import pipeline

    try:
        from torchrec.distributed.train_pipeline.pec_train_pipeline import TrainPipelinePEC
    except ImportError:
        pytest.skip("torchrec's TrainPipelinePEC exists from torchrec 1.9 on")
    theirs = list(inspect.signature(TrainPipelinePEC.__init__).parameters.values())[1:]
    ours = list(inspect.signature(pipeline.TrainPipelinePEC.__init__).parameters.values())[
        1 : len(theirs) + 1
    ]
    assert [(p.name, p.default, p.kind) for p in ours] == [(p.name, p.default, p.kind) for p in theirs], (
        "TrainPipelinePEC's leading parameters differ from torchrec's"
    )
    assert isinstance(pipeline.TrainPipelinePEC, type) and issubclass(
        pipeline.TrainPipelinePEC, pipeline.TrainPipelineSparseDist
    ), "TrainPipelinePEC is not a TrainPipelineSparseDist, as torchrec's is"
