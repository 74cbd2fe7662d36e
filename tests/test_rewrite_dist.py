"""The rewrite on a real sharded EmbeddingBagCollection, 2 gloo ranks, table-wise and column-wise:
input_dist started ahead (for two batches, before either forward) plus the hijacked forward gives
exactly the original forward's output."""

from __future__ import annotations

import pytest

from tests.harness import run_ranks
from tests.models import SHARDINGS

pytestmark = pytest.mark.slow  # 2-rank launches (run_ranks), one per sharding


def _ahead_equals_original(rank: int, world_size: int, sharding: str) -> dict:
    import torch

    from rewrite import ContextSlot, rewrite_model
    from tests import models

    class AheadContext:
        """Starts every module's input_dist at construction; forward takes the result."""

        def __init__(self, rewrite, batch):
            self.requests = {}
            for pm in rewrite.modules:
                args, kwargs = pm.args.build(batch)
                mctx = pm.module.create_context()
                self.requests[pm.fqn] = (mctx, pm.module.input_dist(mctx, *args, **kwargs))

        def take_input_dist(self, fqn):
            mctx, request = self.requests.pop(fqn)
            return mctx, request.wait().wait()

        def take_prefetched(self, fqn):
            return None

        def postproc_result(self, fqn):
            return None

    model, _ = models.build("dlrm", sharding)
    model.eval()
    data = models.batches("dlrm", 2, rank)
    with torch.no_grad():
        expected = [model(b) for b in data]
        slot = ContextSlot()
        rw = rewrite_model(model, data[0], slot=slot)
        contexts = [AheadContext(rw, b) for b in data]  # both all-to-alls in flight at once
        got = []
        for ctx, batch in zip(contexts, data, strict=True):
            slot.current = ctx
            got.append(model(batch))
        slot.current = None
        rw.restore()
        after = [model(b) for b in data]
    return {
        "pipelined": rw.report.pipelined,
        "equal": models.bitwise_equal(expected, got),
        "restored_equal": models.bitwise_equal(expected, after),
    }


@pytest.mark.parametrize("sharding", SHARDINGS)
def test_input_dist_ahead_plus_hijacked_forward_equals_original(sharding):
    for r in run_ranks(_ahead_equals_original, 2, timeout=180, args=(sharding,)):
        assert r["pipelined"] == ["model.sparse_arch.embedding_bag_collection"]
        assert r["equal"]
        assert r["restored_equal"]
