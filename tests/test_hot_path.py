"""The per-step hot path: what a step does only when it has to.

- stage labels enter the profiler only while one records;
- a prefetch stage whose modules' `prefetch()` moves nothing is detected once, runs inline from the
  first batch (no thread hand-off), calls no `prefetch()`, says so in the rewrite report, and stays
  bit for bit;
- a host batch on a host device is not walked or copied.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile

from pipeline.stages import streams
from pipeline.stages.prefetch import prefetch_does_work
from pipeline.stages.streams import Streams
from tests.harness import run_ranks


def test_stage_labels_only_while_a_profiler_records(monkeypatch):
    made: list[str] = []
    real = streams.record_function
    monkeypatch.setattr(streams, "record_function", lambda text: made.append(text) or real(text))
    with streams.run_stage(Streams(), "forward", 3), streams.label("pipeline::x#3"):
        pass
    assert made == []  # no profiler: no record_function at all
    with profile() as prof:
        with streams.run_stage(Streams(), "forward", 4), streams.label("pipeline::x#4"):
            torch.ones(1).add_(1)
    assert made == ["pipeline::forward#4", "pipeline::x#4"]
    names = {e.name for e in prof.events()}
    assert {"pipeline::forward#4", "pipeline::x#4"} <= names


def test_stage_labels_under_a_profiler_of_every_thread():
    """The timeline's profiler (`profile_all_threads=True`), under which torch 2.13's C-side check
    says no profiler is enabled: the labels must still be made."""
    config = _ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CPU], experimental_config=config) as prof:
        with streams.run_stage(Streams(), "forward", 5):
            torch.ones(1).add_(1)
    assert "pipeline::forward#5" in {e.name for e in prof.events()}


def _plan(*kernels: str) -> SimpleNamespace:
    return SimpleNamespace(
        module_sharding_plan={f"t{i}": SimpleNamespace(compute_kernel=k) for i, k in enumerate(kernels)}
    )


def test_prefetch_work_is_read_from_the_kernels():
    assert not prefetch_does_work(_plan("fused", "fused", "dense"))
    assert prefetch_does_work(_plan("fused", "fused_uvm_caching"))
    assert prefetch_does_work(_plan("customized_kernel"))  # e.g. tiered/: a cache to fill
    assert prefetch_does_work(SimpleNamespace())  # unknown module: assume it works


def _idle_prefetch(rank: int, world_size: int) -> dict:
    from pipeline import PrefetchTrainPipelineSparseDist
    from tests import models

    ref_model, ref_opt = models.build("dlrm", "table_wise")
    expected = models.plain_loop(ref_model, ref_opt, models.batches("dlrm", 8, rank))
    model, opt = models.build("dlrm", "table_wise")
    calls = []
    for module in (m for m in model.modules() if hasattr(m, "module_sharding_plan")):
        module.prefetch = lambda *a, **k: calls.append(1)  # must never be called: fused kernels
    pipe = PrefetchTrainPipelineSparseDist(model, opt, torch.device("cpu"))
    it = iter(models.batches("dlrm", 8, rank))
    first = pipe.progress(it)
    ahead_after_first = pipe.prefetch_ahead
    mode = pipe.prefetch_mode
    outputs, stopped = models.outputs_then_stop(pipe, it, 7)
    return {
        "equal": models.bitwise_equal(expected, [first, *outputs]),
        "params": models.bitwise_equal(ref_model.state_dict(), model.state_dict()),
        "stopped": stopped,
        "ahead_after_first": ahead_after_first,
        "calls": len(calls),
        "notes": list(pipe.rewrite_report.notes),
        "mode": mode,
        "threads": [t.name for t in threading.enumerate() if t.name.startswith("pipeline-prefetch")],
    }


@pytest.mark.slow
def test_prefetch_with_nothing_to_prefetch_runs_sparse_dists_step_and_is_exact():
    """Fused kernels: no prefetch() call, no stage, no worker thread, from the first batch on; the
    mode is visible (prefetch_mode, and one note in the rewrite report)."""
    for rank, r in enumerate(run_ranks(_idle_prefetch, 2, timeout=240)):
        assert r["equal"] and r["params"] and r["stopped"], f"rank {rank}: not the plain loop, bit for bit"
        assert r["mode"] == "sparse-dist", f"rank {rank}: mode {r['mode']!r}"
        assert r["ahead_after_first"] is False, f"rank {rank}: the stage was to run ahead"
        assert r["calls"] == 0, f"rank {rank}: prefetch() was called {r['calls']} times"
        assert r["threads"] == [], f"rank {rank}: a prefetch worker thread was started: {r['threads']}"
        notes = [n for n in r["notes"] if "runs TrainPipelineSparseDist's step" in n]
        assert len(notes) == 1, f"rank {rank}: the report says {r['notes']}"


def test_host_batches_are_not_copied():
    from pipeline import TrainPipelineBase

    model = torch.nn.Linear(2, 1)
    seen = []

    def fwd(batch):
        seen.append(batch)
        loss = model(batch["x"]).sum()
        return loss, loss.detach()

    batch = {"x": torch.ones(3, 2)}
    pipe = TrainPipelineBase(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"), fwd)
    pipe.progress(iter([batch]))
    assert seen[0] is batch  # the very object the dataloader gave: nothing walked, nothing made
