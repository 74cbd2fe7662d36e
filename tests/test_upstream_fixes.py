"""A fix torchrec made between 1.8.0 and 1.9.2 that no other test holds ours to (docs/reference.md,
"torchrec 1.8.0 to 1.9.2"): SemiSync's warm-up synchronizes no device.

torchrec 1.8.0's SemiSync called `torch.get_device_module().synchronize()` before each warm-up
lookup: the default accelerator, not the pipeline's device (a CPU pipeline on a GPU host initialised
CUDA); 1.9.2 synchronizes the pipeline's device. Ours orders its stages by hand-offs and never
synchronizes a whole device: on 2 gloo ranks, through the warm-up and past `start_batch`, no
`synchronize()` of torch.cpu, torch.cuda or torch.accelerator is called and CUDA stays
uninitialised, with the semi-sync reference's numbers. The counter's twin: 1.9.2's call, made
inside the same patch, is counted.
"""

from __future__ import annotations

import pytest

from tests.harness import pytest_timeout

TIMEOUT = 150
pytestmark = [pytest.mark.timeout(pytest_timeout(TIMEOUT)), pytest.mark.slow]


def _counting_synchronize(calls: list):
    """Replace every device-wide synchronize with one that records its module; returns an undo."""
    import torch

    modules = [torch.cpu, torch.cuda] + ([torch.accelerator] if hasattr(torch, "accelerator") else [])
    saved = [(m, m.synchronize) for m in modules]
    for m in modules:
        m.synchronize = lambda *a, _name=m.__name__, **k: calls.append(_name)

    def undo() -> None:
        for m, fn in saved:
            m.synchronize = fn

    return undo


def _semi_sync_case(rank: int, world_size: int) -> dict:
    import torch

    from tests.test_family import START_BATCH, _semi

    calls: list[str] = []
    undo = _counting_synchronize(calls)
    try:
        result = _semi(rank, world_size, "dlrm", "table_wise", START_BATCH)
        result["pipeline_calls"] = list(calls)
        torch.get_device_module(torch.device("cpu")).synchronize()  # what torchrec 1.9.2 calls
        result["twin_calls"] = calls[len(result["pipeline_calls"]) :]
    finally:
        undo()
    result["cuda_initialized"] = torch.cuda.is_initialized()
    return result


def test_semi_sync_synchronizes_no_device(pool):
    from tests.test_family import _check_trained

    for rank, r in enumerate(pool.run(_semi_sync_case, timeout=TIMEOUT)):
        _check_trained(r, rank, "the semi-sync reference")
        assert r["pipeline_calls"] == [], f"rank {rank}: SemiSync synchronized {r['pipeline_calls']}"
        assert r["twin_calls"] == ["torch.cpu"], f"rank {rank}: the counter missed torchrec 1.9.2's call"
        assert not r["cuda_initialized"], f"rank {rank}: a CPU pipeline initialised CUDA"
