"""torchrec's own example trainers, with the import changed to `torchrec_pipeline`
(tests/torchrec_examples/README.md says where they come from and what was changed), run as they are
on 2 gloo CPU ranks with small tables and a few steps: each makes its own process group from the
environment, as under torchrun. Per step, the outputs are bit for bit those of the same trainer with
torchrec's `TrainPipelineSparseDist`, and those of a plain loop (zero_grad, forward, backward, step).
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch
import torch.distributed as dist
from torchrec.distributed import train_pipeline as torchrec_pipelines

import pipeline
from tests import models
from tests.harness import free_port, pytest_timeout, run_ranks

TIMEOUT = 240
STEPS = 6
pytestmark = [pytest.mark.timeout(pytest_timeout(TIMEOUT)), pytest.mark.slow]

EXAMPLES = {
    "golden_training.train_dlrm": {"num_embeddings": 64, "embedding_dim": 8, "num_iterations": STEPS},
    "retrieval.two_tower_train": {
        "num_embeddings": 64,
        "embedding_dim": 8,
        "layer_sizes": [8],
        "batch_size": 8,
        "num_iterations": STEPS,
    },
}


class PlainLoop:
    """The trainer's loop without a pipeline: what `progress()` would be with nothing in flight."""

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device
    ) -> None:
        self._model, self._optimizer = model, optimizer

    def progress(self, dataloader_iter):
        batch = next(dataloader_iter)
        self._optimizer.zero_grad()
        loss, output = self._model(batch)
        torch.sum(loss, dim=0).backward()
        self._optimizer.step()
        return output


def _recording(cls: type, outputs: list) -> type:
    """`cls` whose `progress()` also keeps each output (the trainers drop them)."""

    class Recording(cls):
        def progress(self, dataloader_iter):
            output = super().progress(dataloader_iter)
            outputs.append(output)
            report = getattr(self, "rewrite_report", None)
            if report is not None:
                outputs.pipelined = report.pipelined
            return output

    return Recording


class _Outputs(list):
    pipelined: list[str] | None = None


def _train(rank: int, world_size: int, example: str, ports: list[int]) -> dict:
    module = importlib.import_module(f"tests.torchrec_examples.{example}")
    changed = module.TrainPipelineSparseDist is pipeline.TrainPipelineSparseDist
    dist.destroy_process_group()  # the trainer makes its own from the environment, as under torchrun
    os.environ.update(
        LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1"
    )
    runs = {"ours": pipeline.TrainPipelineSparseDist, "torchrec": torchrec_pipelines.TrainPipelineSparseDist}
    runs["plain"] = PlainLoop
    outputs: dict[str, _Outputs] = {}
    try:
        for (run, cls), port in zip(runs.items(), ports, strict=True):
            os.environ["MASTER_PORT"] = str(port)
            outputs[run] = _Outputs()
            module.TrainPipelineSparseDist = _recording(cls, outputs[run])
            torch.manual_seed(1000 + rank)  # the tables' and the data's: distinct on each rank
            module.train(**EXAMPLES[example])
            dist.destroy_process_group()
    finally:
        module.TrainPipelineSparseDist = pipeline.TrainPipelineSparseDist
    return {
        "import_changed": changed,
        "outputs": {run: list(out) for run, out in outputs.items()},
        "pipelined": outputs["ours"].pipelined,
    }


@pytest.mark.parametrize("example", EXAMPLES)
def test_torchrecs_trainer_with_the_import_changed_trains_as_torchrecs(example):
    ports = [free_port() for _ in range(3)]
    results = run_ranks(_train, 2, timeout=TIMEOUT, args=(example, ports))
    for rank, r in enumerate(results):
        ours, theirs, plain = (r["outputs"][run] for run in ("ours", "torchrec", "plain"))
        assert r["import_changed"], (
            f"{example} does not import TrainPipelineSparseDist from torchrec_pipeline"
        )
        assert len(ours) == len(theirs) == len(plain) == STEPS, (
            f"rank {rank}: {example} ran other step counts"
        )
        assert r["pipelined"], f"rank {rank}: {example}: no sharded module was pipelined"
        assert models.bitwise_equal(ours, theirs), f"rank {rank}: {example}: outputs differ from torchrec's"
        assert models.bitwise_equal(ours, plain), (
            f"rank {rank}: {example}: outputs differ from the plain loop"
        )
    # distinct batches on each rank: equal outputs would prove little about the all-to-alls
    assert not models.bitwise_equal(results[0]["outputs"]["ours"], results[1]["outputs"]["ours"])
