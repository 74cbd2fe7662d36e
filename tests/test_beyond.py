"""Two problems torchrec users report and torchrec leaves open, on 2 gloo ranks with real all-to-alls.

- One iterator reused across epochs (a DataLoader with `persistent_workers=True` hands back the same
  iterator object from every `iter()`): torchrec 1.8 remembers the iterator it saw exhausted and
  fetches nothing from it again. Ours trains every batch of every epoch, with
  the plain loop's outputs and parameters bit for bit.
- A dataloader that raises on one rank mid-epoch: that rank re-raises its own exception and the peer
  stops within seconds with `PeerFailedError` naming the failed rank and the exception's text, even
  when the peer was about to create a process group that the failed rank will never join (the
  input all-to-alls' own groups, the votes' group), where `dist.new_group` would wait 300 s.
"""

from __future__ import annotations

import time

import pytest

from tests.harness import pytest_timeout, run_ranks

PIPELINES = ("TrainPipelineBase", "TrainPipelineSparseDist", "PrefetchTrainPipelineSparseDist")
TIMEOUT = 90
pytestmark = [pytest.mark.timeout(pytest_timeout(TIMEOUT)), pytest.mark.slow]

# -- one iterator, three epochs ----------------------------------------------------------------

EPOCHS, PER_EPOCH = 3, 7


class _Batches:
    """A map-style dataset whose items are whole batches (the DataLoader runs with batch_size=None)."""

    def __init__(self, batches: list) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int):
        return self.batches[i]


def _persistent_loader(rank: int):
    """A DataLoader with one persistent worker, shuffled by a seeded generator: every epoch trains
    the same batches in another order, and `iter()` returns the same iterator object each time."""
    import torch

    from tests import models

    return torch.utils.data.DataLoader(
        _Batches(models.batches("dlrm", PER_EPOCH, rank)),
        batch_size=None,
        shuffle=True,
        generator=torch.Generator().manual_seed(rank),
        num_workers=1,
        persistent_workers=True,
        multiprocessing_context="fork",  # a spawned worker imports torch again: 15 s on busy cores
    )


def _epochs(rank: int, world_size: int, pipe_name: str, sharding: str) -> dict:
    import gc
    import multiprocessing

    import torch

    import pipeline
    from tests import models

    # The harness's ranks are daemon processes, which multiprocessing forbids to have children;
    # DataLoader workers watch their parent and exit when it does, so lifting the flag is safe.
    multiprocessing.current_process()._config["daemon"] = False
    # An earlier scenario's persistent DataLoader still uncollected would be collected again in the
    # worker forked below, which then stalls 5 s trying to stop workers that are not its children.
    gc.collect()
    ref_model, ref_opt = models.build("dlrm", sharding)
    ref_loader = _persistent_loader(rank)
    expected = [models.plain_loop(ref_model, ref_opt, list(ref_loader)) for _ in range(EPOCHS)]
    model, opt = models.build("dlrm", sharding)
    pipe = getattr(pipeline, pipe_name)(model, opt, torch.device("cpu"))
    loader = _persistent_loader(rank)
    outputs, iterators, seconds = [], set(), []
    for _ in range(EPOCHS):
        start = time.monotonic()
        it = iter(loader)
        iterators.add(id(it))
        outputs.append(models.run_to_end(pipe, it, limit=PER_EPOCH))
        seconds.append(time.monotonic() - start)
    return {
        "per_epoch": [len(o) for o in outputs],
        "iterators": len(iterators),
        "outputs": models.bitwise_equal(expected, outputs),
        "params": models.bitwise_equal(ref_model.state_dict(), model.state_dict()),
        "seconds": seconds,
    }


@pytest.mark.parametrize(
    ("pipe_name", "sharding"),
    [(p, "table_wise") for p in PIPELINES] + [("TrainPipelineSparseDist", "column_wise")],
)
def test_one_iterator_reused_over_epochs_trains_every_batch_of_every_epoch(pool, pipe_name, sharding):
    for rank, r in enumerate(pool.run(_epochs, pipe_name, sharding, timeout=TIMEOUT)):
        assert r["iterators"] == 1, f"rank {rank}: the DataLoader made a new iterator each epoch"
        assert r["per_epoch"] == [PER_EPOCH] * EPOCHS, r
        assert r["outputs"] and r["params"], f"rank {rank}: not the plain loop's outputs and parameters"
        # no stall between epochs: a later epoch takes about as long as the first (which also
        # rewrites the model and tunes), not seconds more
        assert max(r["seconds"][1:]) < r["seconds"][0] + 2.0, r["seconds"]


# -- a dataloader that raises on one rank ----------------------------------------------------------


def _loader_raises(rank: int, world_size: int, pipe_name: str, at: int) -> dict:
    """Rank 1's dataloader raises OSError when asked for batch `at`; what ended each rank, when."""
    import torch

    import pipeline
    from tests import models

    model, opt = models.build("dlrm", "table_wise")
    pipe = getattr(pipeline, pipe_name)(model, opt, torch.device("cpu"))
    raised_at = None

    def data():
        nonlocal raised_at
        for i, batch in enumerate(models.batches("dlrm", 12, rank)):
            if rank == 1 and i == at:
                raised_at = time.time()
                raise OSError(f"disk read failed at batch {i}")
            yield batch

    it, trained = data(), 0
    try:
        while True:
            pipe.progress(it)
            trained += 1
    except StopIteration:
        return {"error": None, "trained": trained}
    except Exception as e:  # whichever error ends the rank is the result
        return {"error": f"{type(e).__name__}: {e}", "at": time.time(), "raised_at": raised_at}


# Mid-epoch for every class (SparseDist and Prefetch: while the peer installs the input
# all-to-alls' own process groups, should the schedule's watch switch at that step), and at the first
# batch (the peer creates the votes' process group).
@pytest.mark.parametrize(("pipe_name", "at"), [(p, 5) for p in PIPELINES] + [("TrainPipelineSparseDist", 0)])
def test_a_dataloader_raising_on_one_rank_ends_every_rank(pipe_name, at):
    r0, r1 = run_ranks(_loader_raises, 2, timeout=TIMEOUT, args=(pipe_name, at))
    assert r1["error"] == f"OSError: disk read failed at batch {at}", r1
    assert r0["error"] is not None and r0["error"].startswith("PeerFailedError"), r0
    assert f"rank 1 raised OSError: disk read failed at batch {at}" in r0["error"], r0
    # docs/pipeline.md: a peer in a collective with the failed rank ends when that rank closes its
    # groups after `failure_grace` (2 s), about 3 s in all; one about to create a group ends at once
    waited = r0["at"] - r1["raised_at"]
    assert waited < 2.0 + 6.0, f"rank 0 ended {waited:.1f} s after rank 1's dataloader raised"
