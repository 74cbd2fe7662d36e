"""torchrec's memory and ordering flags do what torchrec's do, and leave the numbers alone.

On 2 gloo ranks with real all-to-alls, table-wise and column-wise DLRM and distinct batches: each flag,
on each of our classes whose torchrec counterpart takes it, gives the plain loop's per-step outputs
and final parameters bit for bit, one output per batch and then StopIteration.
`clear_data_dist_inputs` frees the tensors the input all-to-alls sent and
`free_features_storage_early` the features the sharded modules permuted away (both counted in
`released_bytes`); `enable_inplace_copy_batch` only changes where a GPU allocates the copy (on CPU
nothing is copied); `enqueue_batch_after_forward` moves the copy of batch i+2 after forward of i
(RecordingStreams' stage log).
"""

from __future__ import annotations

import itertools

import pytest

from tests.harness import run_ranks

pytestmark = pytest.mark.slow  # scenarios on 2 gloo ranks

FLAGS = {
    "TrainPipelineSparseDist": (
        "enable_inplace_copy_batch",
        "free_features_storage_early",
        "clear_data_dist_inputs",
        "enqueue_batch_after_forward",
    ),
    "PrefetchTrainPipelineSparseDist": (
        "enable_inplace_copy_batch",
        "free_features_storage_early",
        "clear_data_dist_inputs",
    ),
    "TrainPipelineFusedSparseDist": (
        "enable_inplace_copy_batch",
        "free_features_storage_early",
        "clear_data_dist_inputs",
        "enqueue_batch_after_forward",
    ),
    "TrainPipelineBase": ("enable_inplace_copy_batch",),
}
CASES = [
    (p, f, s)
    for p, flags in FLAGS.items()
    for f, s in itertools.product(flags, ("table_wise", "column_wise"))
]
STEPS = 8


def _flag_case(rank: int, pipe_name: str, flag: str, sharding: str) -> dict:
    import torch

    import pipeline
    from tests import models

    ref_model, ref_opt = models.build("dlrm", sharding)
    expected = models.plain_loop(ref_model, ref_opt, models.batches("dlrm", STEPS, rank))
    model, opt = models.build("dlrm", sharding)
    pipe = getattr(pipeline, pipe_name)(model, opt, torch.device("cpu"), **{flag: True})
    # fresh batches: free_features_storage_early frees the batch's own KeyedJaggedTensor on CPU
    outputs, stopped = models.outputs_then_stop(pipe, iter(models.batches("dlrm", STEPS, rank)), STEPS)
    return {
        "outputs": models.bitwise_equal(expected, outputs),
        "params": models.bitwise_equal(ref_model.state_dict(), model.state_dict()),
        "stopped": stopped,
        "released": getattr(pipe, "released_bytes", None),
    }


def _copy_order(rank: int, pipe_name: str, late: bool) -> list[str]:
    """The stage names in the order they ran, on RecordingStreams."""
    import torch

    import pipeline
    from tests import models

    def make(streams):
        model, opt = models.build("dlrm", "table_wise")
        options = {"enqueue_batch_after_forward": late, "streams": streams}
        return getattr(pipeline, pipe_name)(model, opt, torch.device("cpu"), **options)

    result, streams = models.recorded_run(make, models.batches("dlrm", STEPS, rank), broken=False)
    assert result["error"] is None and result["outputs"] == STEPS, result
    return [e[1] for e in streams.log if e[0] == "stage"]


def _run_all(rank: int, world_size: int) -> dict:
    out = {case: _flag_case(rank, *case) for case in CASES}
    for pipe_name in ("TrainPipelineSparseDist", "TrainPipelineFusedSparseDist"):
        for late in (False, True):
            out["order", pipe_name, late] = _copy_order(rank, pipe_name, late)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_run_all, 2, timeout=400)


@pytest.mark.parametrize(("pipe_name", "flag", "sharding"), CASES)
def test_flag_leaves_the_numbers_unchanged(results, pipe_name, flag, sharding):
    for rank, per_rank in enumerate(results):
        r = per_rank[pipe_name, flag, sharding]
        assert r["outputs"], f"rank {rank}: per-step outputs differ from the plain loop"
        assert r["params"], f"rank {rank}: final parameters differ from the plain loop"
        assert r["stopped"], f"rank {rank}: no StopIteration after {STEPS} outputs"
        if flag == "clear_data_dist_inputs":
            assert r["released"] > 0, "the input all-to-alls' send buffers were not freed"
        if flag == "free_features_storage_early":
            assert r["released"] > 0, "the batches' permuted-away features were not freed"


@pytest.mark.parametrize("pipe_name", ["TrainPipelineSparseDist", "TrainPipelineFusedSparseDist"])
def test_enqueue_batch_after_forward_moves_the_copy_after_forward(results, pipe_name):
    for per_rank in results:
        for late in (False, True):
            names = per_rank["order", pipe_name, late]
            after_forward = sum(1 for pair in itertools.pairwise(names) if pair == ("forward", "copy"))
            assert names.count("copy") == STEPS
            # batches 2..STEPS-1 are copied during the steps: right after a forward, or before it
            assert after_forward == (STEPS - 2 if late else 0), (late, names)
