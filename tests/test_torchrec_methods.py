"""torchrec's public methods and subclass points on our classes.

1. Every public method of torchrec's pipeline classes, and the protected ones users override, is on
   ours with the same name and parameters (one process).
2. A user's own `progress()` that calls torchrec's methods in torchrec's order (fill, wait for the
   batch, start the next batch's sparse data dist, enqueue, forward, wait the data dist,
   backward, optimizer, dequeue) trains bit for bit as the plain loop, and as torchrec's own class
   with the same `progress()` (2 gloo ranks).
3. A subclass's `_next_batch`, `_backward`, `_optimizer_step` and `_wait_for_batch` are called by our
   steps: each override gives the plain loop that does the same thing, bit for bit, and that loop
   differs from the plain loop without it (the negative twin) (2 gloo ranks).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torchrec.datasets.utils import Batch
from torchrec.distributed import train_pipeline as torchrec_pipelines
from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSemiSync as TorchrecSemiSync

import pipeline
from tests import models
from tests.harness import pytest_timeout

STEPS = 9
TIMEOUT = 120
pytestmark = [pytest.mark.timeout(pytest_timeout(TIMEOUT)), pytest.mark.slow]

CLASSES = {
    "TrainPipelineBase": torchrec_pipelines.TrainPipelineBase,
    "TrainPipelineSparseDist": torchrec_pipelines.TrainPipelineSparseDist,
    "PrefetchTrainPipelineSparseDist": torchrec_pipelines.PrefetchTrainPipelineSparseDist,
    "TrainPipelineFusedSparseDist": torchrec_pipelines.TrainPipelineFusedSparseDist,
    "TrainPipelineSemiSync": TorchrecSemiSync,
    "EvalPipelineSparseDist": torchrec_pipelines.EvalPipelineSparseDist,
    "TrainPipelinePT2": torchrec_pipelines.TrainPipelinePT2,
    "TrainPipelineSparseDistCompAutograd": torchrec_pipelines.TrainPipelineSparseDistCompAutograd,
    "StagedTrainPipeline": torchrec_pipelines.StagedTrainPipeline,
}
SUBCLASS_POINTS = ("_next_batch", "_backward", "_optimizer_step", "_wait_for_batch")


def _methods(cls: type) -> list[str]:
    """torchrec's public methods of `cls`, and the subclass points it has."""
    names = [n for n in dir(cls) if not n.startswith("_") and callable(getattr(cls, n))]
    return names + [n for n in SUBCLASS_POINTS if hasattr(cls, n)]


def _parameters(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


@pytest.mark.parametrize(("name", "method"), [(n, m) for n, cls in CLASSES.items() for m in _methods(cls)])
def test_torchrecs_method_is_ours_with_its_parameters(name, method):
    ours = getattr(pipeline, name)
    assert hasattr(ours, method), f"{name} has no {method}() (torchrec's class has)"
    assert _parameters(getattr(ours, method)) == _parameters(getattr(CLASSES[name], method))


@pytest.mark.parametrize("attribute", ["batches", "contexts"])
def test_torchrecs_queues_are_properties_of_the_sparse_dist_family(attribute):
    for name in ("TrainPipelineSparseDist", "TrainPipelineFusedSparseDist", "TrainPipelineSemiSync"):
        assert isinstance(getattr(getattr(pipeline, name), attribute), property), (name, attribute)


# -- a user's own progress(), in torchrec's order ------------------------------------------------


class TorchrecOrder:
    """A user's `progress()` for a TrainPipelineSparseDist subclass, with torchrec's methods and
    attributes only, in the order torchrec's own step runs its stages."""

    def progress(self, dataloader_iter):
        self.fill_pipeline(dataloader_iter)
        if not self.batches:
            raise StopIteration
        if self._model.training:
            self._optimizer.zero_grad()
        self._wait_for_batch()
        if len(self.batches) >= 2:
            self.start_sparse_data_dist(self.batches[1], self.contexts[1])
        self.enqueue_batch(dataloader_iter)
        losses, output = self._model_fwd(self.batches[0])
        if len(self.batches) >= 2:
            self.wait_sparse_data_dist(self.contexts[1])
        if self._model.training:
            self._backward(losses)
            self._optimizer_step()
        self.dequeue_batch()
        return output


class ClearingOrder(TorchrecOrder):
    """TorchrecOrder under `clear_data_dist_inputs`, whose step torchrec begins by freeing what the input
    all-to-alls of batch i sent (`clear_sparse_data_dist_inputs`)."""

    def __init__(self, model, optimizer, device):
        super().__init__(model, optimizer, device, clear_data_dist_inputs=True)

    def progress(self, dataloader_iter):
        if self._clear_data_dist_inputs and self.contexts:
            self.clear_sparse_data_dist_inputs(self.contexts[0])
        return super().progress(dataloader_iter)


class FusedOrder:
    """The same for a TrainPipelineFusedSparseDist: the lookup of batch i before anything else."""

    def progress(self, dataloader_iter):
        self.fill_pipeline(dataloader_iter)
        if not self.batches:
            raise StopIteration
        self.start_embedding_lookup(self.batches[0], self.contexts[0])
        if self._model.training:
            self._optimizer.zero_grad()
        self._wait_for_batch()
        if len(self.batches) >= 2:
            self.start_sparse_data_dist(self.batches[1], self.contexts[1])
        self.enqueue_batch(dataloader_iter)
        self.wait_embedding_lookup()
        losses, output = self._model_fwd(self.batches[0])
        if len(self.batches) >= 2:
            self.wait_sparse_data_dist(self.contexts[1])
        if self._model.training:
            self._backward(losses)
            self._optimizer_step()
        self.dequeue_batch()
        return output


def _run_own_progress(rank: int, world_size: int, order: str, base: str, kind: str, sharding: str) -> dict:
    mixin = {"TorchrecOrder": TorchrecOrder, "ClearingOrder": ClearingOrder, "FusedOrder": FusedOrder}[order]
    cls = type(f"Own{base}", (mixin, getattr(pipeline, base)), {})
    ref_model, ref_opt = models.build(kind, sharding)
    expected = models.plain_loop(ref_model, ref_opt, models.batches(kind, STEPS, rank))
    model, opt = models.build(kind, sharding)
    pipe = cls(model, opt, torch.device("cpu"))
    outputs, stopped = models.outputs_then_stop(pipe, iter(models.batches(kind, STEPS, rank)), STEPS)
    result = {
        "outputs": models.bitwise_equal(expected, outputs),
        "params": models.bitwise_equal(ref_model.state_dict(), model.state_dict()),
        "stopped": stopped,
        "pipelined": pipe.rewrite_report.pipelined,
        "left": len(pipe.contexts),
        "released": pipe.released_bytes,
    }
    if kind == "dlrm" and order == "TorchrecOrder":  # torchrec's class needs Pipelineable batches
        theirs_cls = type("Theirs", (mixin, torchrec_pipelines.TrainPipelineSparseDist), {})
        their_model, their_opt = models.build(kind, sharding)
        theirs = theirs_cls(their_model, their_opt, torch.device("cpu"))
        their_outputs = models.run_to_end(theirs, iter(models.batches(kind, STEPS, rank)))
        result["torchrecs"] = models.bitwise_equal(their_outputs, outputs)
    return result


@pytest.mark.parametrize(
    ("order", "base", "kind", "sharding"),
    [
        ("TorchrecOrder", "TrainPipelineSparseDist", "dlrm", "table_wise"),
        ("TorchrecOrder", "TrainPipelineSparseDist", "nested", "row_wise"),
        ("ClearingOrder", "TrainPipelineSparseDist", "dlrm", "column_wise"),
        ("FusedOrder", "TrainPipelineFusedSparseDist", "dlrm", "column_wise"),
    ],
)
def test_own_progress_in_torchrecs_order_trains_as_the_plain_loop(pool, order, base, kind, sharding):
    for rank, r in enumerate(pool.run(_run_own_progress, order, base, kind, sharding, timeout=TIMEOUT)):
        assert r["outputs"], f"rank {rank}: {order} on {base}: outputs differ from the plain loop"
        assert r["params"], f"rank {rank}: {order} on {base}: parameters differ from the plain loop"
        assert r["stopped"] and r["left"] == 0, f"rank {rank}: {order}: no clean end ({r})"
        assert r["pipelined"], f"rank {rank}: {order}: nothing was pipelined, the test proves nothing"
        if order == "ClearingOrder":
            assert r["released"] > 0, f"rank {rank}: clear_sparse_data_dist_inputs freed nothing"
        if "torchrecs" in r:
            assert r["torchrecs"], f"rank {rank}: torchrec's class with the same progress() differs"


# -- subclass points ------------------------------------------------------------------------------


def _double_dense(batch: Batch) -> Batch:
    return Batch(
        dense_features=batch.dense_features * 2, sparse_features=batch.sparse_features, labels=batch.labels
    )


class HalfLoss:
    def _backward(self, losses):
        super()._backward(losses * 0.5)


class SkipEveryThird:
    """Drops the batches at positions 2, 5, 8, ... and doubles the dense features of the others."""

    def _next_batch(self, dataloader_iter):
        while True:
            batch = super()._next_batch(dataloader_iter)
            self.position = getattr(self, "position", -1) + 1
            if batch is None or self.position % 3 != 2:
                return None if batch is None else _double_dense(batch)


class StepEveryOther:
    def _optimizer_step(self):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls % 2:
            super()._optimizer_step()


class RecordWaits:
    """Records the batch each step waits for (Base passes it; the others wait for batches[0])."""

    def _wait_for_batch(self, *cur_batch):
        self.waited = [*getattr(self, "waited", []), cur_batch[0] if cur_batch else self.batches[0]]
        super()._wait_for_batch(*cur_batch)


def _reference(hook: str, model, opt, data: list) -> list:
    """The plain loop that does what the override does."""
    if hook == "_next_batch":
        return models.plain_loop(model, opt, [_double_dense(b) for i, b in enumerate(data) if i % 3 != 2])
    outputs = []
    for i, batch in enumerate(data):
        opt.zero_grad()
        loss, out = model(batch)
        (loss * 0.5 if hook == "_backward" else loss).backward()
        if hook != "_optimizer_step" or i % 2 == 0:
            opt.step()
        outputs.append(out)
    return outputs


HOOKS = {"_backward": HalfLoss, "_next_batch": SkipEveryThird, "_optimizer_step": StepEveryOther}
OVERRIDES = [
    *[
        ("_backward", c)
        for c in ("TrainPipelineBase", "TrainPipelineSparseDist", "PrefetchTrainPipelineSparseDist")
    ],
    *[("_backward", c) for c in ("TrainPipelineFusedSparseDist", "TrainPipelineSemiSync")],
    *[
        ("_next_batch", c)
        for c in ("TrainPipelineBase", "TrainPipelineSparseDist", "TrainPipelineFusedSparseDist")
    ],
    *[("_optimizer_step", c) for c in ("TrainPipelineSparseDist", "TrainPipelineFusedSparseDist")],
]


def _run_override(rank: int, world_size: int, hook: str, base: str) -> dict:
    data = models.batches("dlrm", STEPS, rank)
    ref_model, ref_opt = models.build("dlrm", "table_wise")
    expected = _reference(hook, ref_model, ref_opt, data)
    plain_model, plain_opt = models.build("dlrm", "table_wise")
    plain = models.plain_loop(plain_model, plain_opt, data)
    cls = type(f"{base}{hook}", (HOOKS[hook], getattr(pipeline, base)), {})
    model, opt = models.build("dlrm", "table_wise")
    # SemiSync from its first batch on would train one step stale: keep its warm-up (the plain loop)
    options = {"start_batch": STEPS} if base == "TrainPipelineSemiSync" else {}
    outputs = models.run_to_end(cls(model, opt, torch.device("cpu"), **options), iter(data))
    return {
        "equal": models.bitwise_equal(expected, outputs) and len(outputs) == len(expected),
        "params": models.bitwise_equal(ref_model.state_dict(), model.state_dict()),
        "twin_differs": not models.bitwise_equal(ref_model.state_dict(), plain_model.state_dict()),
        "plain_steps": len(plain),
    }


@pytest.mark.parametrize(("hook", "base"), OVERRIDES)
def test_a_subclass_override_is_honoured(pool, hook, base):
    for rank, r in enumerate(pool.run(_run_override, hook, base, timeout=TIMEOUT)):
        assert r["twin_differs"], (
            f"rank {rank}: {hook}: the override changes nothing, the test proves nothing"
        )
        assert r["equal"], f"rank {rank}: {base} with its {hook} overridden: outputs differ from the loop"
        assert r["params"], f"rank {rank}: {base} with its {hook} overridden: parameters differ from the loop"


def _run_waits(rank: int, world_size: int, base: str) -> dict:
    data = models.batches("dlrm", STEPS, rank)
    model, opt = models.build("dlrm", "table_wise")
    pipe = type(f"{base}Waits", (RecordWaits, getattr(pipeline, base)), {})(model, opt, torch.device("cpu"))
    models.run_to_end(pipe, iter(data))
    return {"waited_for_each_batch_in_order": [id(b) for b in pipe.waited] == [id(b) for b in data]}


@pytest.mark.parametrize("base", ["TrainPipelineBase", "TrainPipelineSparseDist", "TrainPipelineSemiSync"])
def test_wait_for_batch_override_is_called_once_per_step_with_the_head_batch(pool, base):
    for rank, r in enumerate(pool.run(_run_waits, base, timeout=TIMEOUT)):
        assert r["waited_for_each_batch_in_order"], (
            f"rank {rank}: {base}'s steps did not call _wait_for_batch"
        )


def _run_semi_sync_and_hooks(rank: int, world_size: int) -> dict:
    from torchrec.distributed.train_pipeline.backward_injection import (
        FirstGradTensorFinder,
        InjectionSite,
        InjectionTargetType,
    )

    model, opt = models.build("dlrm", "table_wise")
    pipe = pipeline.TrainPipelineSemiSync(model, opt, torch.device("cpu"), start_batch=3)
    fired = []
    site = InjectionSite(
        fqn="model.dense_arch",
        tensor_finder=FirstGradTensorFinder(),
        target_type=InjectionTargetType.PARAM_GRAD,
    )
    pipe.register_backward_hook(site, lambda p: fired.append(p is pipe))
    it = iter(models.batches("dlrm", 6, rank))
    semi = [pipe.is_semi_sync()]
    heads = []
    for _ in range(6):
        pipe.progress(it)
        heads.append(pipe.contexts[0].index if pipe.contexts else None)
        semi.append(pipe.is_semi_sync())
    batch = pipe.batches[0] if pipe.batches else None
    return {
        "semi": semi,
        "heads": heads,
        "fired": fired,
        "extract": pipe.extract_model_input_from_batch(batch),
    }


def test_semi_sync_methods_and_backward_hooks(pool):
    for rank, r in enumerate(pool.run(_run_semi_sync_and_hooks, timeout=TIMEOUT)):
        # is_semi_sync: the head batch (the next forward's) is at or past start_batch
        expected = [False] + [h is not None and h >= 3 for h in r["heads"]]
        assert r["semi"] == expected and any(expected), f"rank {rank}: is_semi_sync said {r['semi']}"
        assert r["fired"] == [True] * 6, f"rank {rank}: the backward hook fired {r['fired']}"
        assert r["extract"] is None
