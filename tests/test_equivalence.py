"""Headline test: every pipeline gives the plain loop's outputs and parameters bit for bit.

3 pipelines x 4 models (DLRM on torchrec's Batch, two towers on a nested dataclass and on a dict, a
feature-processed EBC with position weights) x table-wise, column-wise and row-wise sharding, on 2
gloo ranks with real all-to-alls and 20 distinct batches per rank. Each case is one scenario on the
module's pair of ranks (tests/harness.py), asserted in its own test; the plain loop's run is made
once per (model, sharding) on those ranks and kept for the three pipelines (`models.reference`).
"""

from __future__ import annotations

import itertools

import pytest

from tests.harness import pytest_timeout
from tests.models import KINDS, SHARDINGS

PIPELINES = ("TrainPipelineBase", "TrainPipelineSparseDist", "PrefetchTrainPipelineSparseDist")
CASES = list(itertools.product(PIPELINES, KINDS, SHARDINGS))
STEPS = 20
TIMEOUT = 120
pytestmark = pytest.mark.timeout(pytest_timeout(TIMEOUT))


def _case(rank: int, world_size: int, pipe_name: str, kind: str, sharding: str) -> dict:
    import torch

    import pipeline
    from tests import models

    expected, ref_state = models.reference(kind, sharding, STEPS, rank)  # once per (kind, sharding)
    model, opt = models.build(kind, sharding)
    pipe = getattr(pipeline, pipe_name)(model, opt, torch.device("cpu"))
    # a fresh copy of the batches: row-wise FP-EBC input_dist writes weights into the KJTs
    it = iter(models.batches(kind, STEPS, rank))
    outputs, stopped = models.outputs_then_stop(pipe, it, STEPS)
    report = getattr(pipe, "rewrite_report", None)
    return {
        "outputs_equal": models.bitwise_equal(expected, outputs),
        "params_equal": models.bitwise_equal(ref_state, model.state_dict()),
        "n_params": len(models.flat_tensors(model.state_dict())),
        "stopped": stopped,
        "pipelined": None if report is None else report.pipelined,
        "not_pipelined": None if report is None else [m.fqn for m in report.not_pipelined],
        "ahead": getattr(pipe, "prefetch_ahead", None),
    }


@pytest.mark.parametrize(("pipe_name", "kind", "sharding"), CASES)
def test_bitwise_equal_to_plain_loop(pool, pipe_name, kind, sharding):
    for rank, r in enumerate(pool.run(_case, pipe_name, kind, sharding, timeout=TIMEOUT)):
        assert r["outputs_equal"], f"rank {rank}: per-step outputs differ from the plain loop"
        assert r["params_equal"], f"rank {rank}: final parameters differ from the plain loop"
        assert r["n_params"] > 0, f"rank {rank}: no parameters compared"
        assert r["stopped"], f"rank {rank}: no StopIteration after {STEPS} outputs"
        if pipe_name != "TrainPipelineBase":
            # equivalence must come from pipelining every sharded module, not from falling back
            assert r["not_pipelined"] == [] and r["pipelined"], r
        if pipe_name.startswith("Prefetch"):
            # fused kernels' prefetch() does nothing: "auto" moved the stage back to the main thread
            # after its first batches, mid-run, and the results stayed bit for bit
            assert r["ahead"] is False, r
