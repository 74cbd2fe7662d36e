"""Programs on real sharded EmbeddingBagCollections, 2 gloo ranks, distinct batches per rank: a KJT
split between two collections, and one collection called on the batch's KJT and on a KJT built from
plain tensors. The input_dist of every call site is started ahead for two batches (both in flight
before either forward), from the replayed programs; the hijacked forwards then give exactly the
original forward's output, traced and recorded alike."""

from __future__ import annotations

import pytest

from tests.harness import run_ranks

pytestmark = pytest.mark.slow  # 2-rank launches (run_ranks)

_SHARDINGS = ("table_wise", "column_wise")


def _build(sharding: str, untraceable: bool):
    import torch
    import torch.distributed as dist
    from torch import nn
    from torchrec import EmbeddingBagCollection, KeyedJaggedTensor
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    from tests.models import DIM, tables

    class SplitAndShared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = EmbeddingBagCollection(tables=tables("a", 2), device=torch.device("cpu"))
            self.b = EmbeddingBagCollection(tables=tables("b", 1), device=torch.device("cpu"))
            self.h = EmbeddingBagCollection(tables=tables("h", 1), device=torch.device("cpu"))

        def forward(self, batch: dict) -> torch.Tensor:
            if untraceable and batch["ids"].sum() >= 0:  # data-dependent control flow
                batch = dict(batch)
            parts = batch["sparse"].split([2, 1])
            built = KeyedJaggedTensor.from_lengths_sync(keys=["hf0"], values=batch["ids"], lengths=batch["n"])
            outs = [self.a(parts[0]), self.b(parts[1]), self.h(batch["history"]), self.h(built)]
            return torch.cat([o.values() for o in outs], dim=1)

    torch.manual_seed(0)
    model = SplitAndShared()
    sharder = EmbeddingBagCollectionSharder()
    names = [t.name for m in (model.a, model.b, model.h) for t in m.embedding_bag_configs()]
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=dist.get_world_size(), compute_device="cpu"),
        constraints={
            n: ParameterConstraints(
                sharding_types=[sharding], min_partition=DIM // 2 if sharding == "column_wise" else None
            )
            for n in names
        },
    )
    plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    return DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])


def _batches(rank: int) -> list[dict]:
    """Two distinct batches for `rank`: `sparse` (features af0, af1, bf0), `history` (hf0), and the
    ids and lengths of a KJT the model builds (hf0)."""
    import torch
    from torchrec import KeyedJaggedTensor

    from tests.models import BATCH, MAX_BAG, ROWS

    gen = torch.Generator().manual_seed(7 + rank)

    def bags(n: int) -> tuple:
        lengths = torch.randint(0, MAX_BAG + 1, (n * BATCH,), generator=gen)
        return torch.randint(0, ROWS, (int(lengths.sum()),), generator=gen), lengths

    out = []
    for _ in range(2):
        (sparse_ids, sparse_n), (h_ids, h_n), (ids, n) = bags(3), bags(1), bags(1)
        sparse = KeyedJaggedTensor.from_lengths_sync(
            keys=["af0", "af1", "bf0"], values=sparse_ids, lengths=sparse_n
        )
        history = KeyedJaggedTensor.from_lengths_sync(keys=["hf0"], values=h_ids, lengths=h_n)
        out.append({"sparse": sparse, "history": history, "ids": ids, "n": n})
    return out


def _ahead_equals_original(rank: int, world_size: int, sharding: str, untraceable: bool) -> dict:
    import torch

    from rewrite import ContextSlot, rewrite_model
    from tests import models

    class AheadContext:
        """Starts every call site's input_dist at construction; forward takes the result."""

        def __init__(self, rewrite, batch):
            self.requests = {}
            for site, args, kwargs in rewrite.site_inputs(batch, {}):
                mctx = site.module.create_context()
                self.requests[site.key] = (mctx, site.module.input_dist(mctx, *args, **kwargs))

        def take_input_dist(self, key):
            mctx, request = self.requests.pop(key)
            return mctx, request.wait().wait()

    model = _build(sharding, untraceable)
    model.eval()
    data = _batches(rank)
    with torch.no_grad():
        expected = [model(b) for b in data]
        slot = ContextSlot()
        rw = rewrite_model(model, data[0], slot=slot, record=True)
        needed = rw.needs_recording
        if needed:
            with rw.record(data[0]):
                model(data[0])
        contexts = [AheadContext(rw, b) for b in data]  # both batches' all-to-alls in flight
        got = []
        for ctx, batch in zip(contexts, data, strict=True):
            slot.current = ctx
            got.append(model(batch))
            slot.check_calls()
        swapped = AheadContext(rw, data[0])  # negative twin: the shared module's two sites swapped
        swapped.requests["h"], swapped.requests["h@1"] = swapped.requests["h@1"], swapped.requests["h"]
        slot.current = swapped
        wrong = model(data[0])
        slot.current = None
        rw.restore()
        after = [model(b) for b in data]
    return {
        "needed_recording": needed,
        "sites": {s.key: s.program for s in rw.report.sites},
        "methods": sorted({m.method for m in rw.report.modules}),
        "equal": models.bitwise_equal(expected, got),
        "restored_equal": models.bitwise_equal(expected, after),
        "swapped_equal": models.bitwise_equal(expected[0], wrong),
    }


@pytest.mark.parametrize("untraceable", [False, True], ids=["traced", "recorded"])
@pytest.mark.parametrize("sharding", _SHARDINGS)
def test_replayed_programs_feed_real_input_dists(sharding, untraceable):
    split = "batch['sparse'].split([2, 1])"
    built = "KeyedJaggedTensor.from_lengths_sync(keys=['hf0'], values=batch['ids'], lengths=batch['n'])"
    for r in run_ranks(_ahead_equals_original, 2, timeout=240, args=(sharding, untraceable)):
        assert r["needed_recording"] is untraceable
        assert r["methods"] == ["recorded" if untraceable else "traced"]
        assert r["sites"] == {
            "a": f"{split}[0]",
            "b": f"{split}[1]",
            "h": "batch['history']",
            "h@1": built,
        }
        assert r["equal"], f"{sharding} {untraceable}: pipelined output differs from the original"
        assert r["restored_equal"]
        assert not r["swapped_equal"], "the shared module's call sites must not be interchangeable"
