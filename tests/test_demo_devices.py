"""`make demo` and the DLRM example on machines with no GPU, one, two and four, faked on CPU by
patching `torch.cuda.is_available` and `torch.cuda.device_count`: no rank is given a GPU that is not
there (the bug: 2 ranks on a one-GPU machine, rank 1 asking for cuda:1), the demo starts one rank
per GPU where there are two or more and 2 CPU ranks otherwise, and says so in one line. The twins
run the same check on the rule before the fix (cuda:LOCAL_RANK whenever CUDA is available, 2 ranks
always), which must fail it on one GPU.
"""

from __future__ import annotations

import pytest
import torch

from examples.dlrm import devices
from examples.dlrm import train as train_script
from examples.dlrm.config import InputError


@pytest.fixture
def gpus(monkeypatch):
    """`gpus(n)` makes torch see `n` GPUs (none: CUDA unavailable)."""

    def fake(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return fake


def missing_gpus(device_per_rank: list[str], count: int) -> list[str]:
    """The devices asked for that this machine of `count` GPUs does not have."""
    return [d for d in device_per_rank if d.startswith("cuda") and int(d.split(":")[1]) >= count]


def ranks_of(layout: devices.DemoLayout) -> list[str]:
    """The device `train.py --device <layout.device>` gives each of the demo's local ranks."""
    return [devices.rank_device(layout.device, r, layout.nproc) for r in range(layout.nproc)]


@pytest.mark.parametrize(
    ("count", "nproc", "device", "says"),
    [
        (0, 2, "cpu", "2 CPU ranks (gloo): no GPU here"),
        (1, 2, "cpu", "2 CPU ranks (gloo): one GPU here"),
        (2, 2, "cuda", "2 rank(s), one GPU each (NCCL)"),
        (4, 4, "cuda", "4 rank(s), one GPU each (NCCL)"),
    ],
)
def test_the_demo_gives_every_rank_a_device_that_exists(gpus, count, nproc, device, says):
    gpus(count)
    layout = devices.demo_layout()
    assert (layout.nproc, layout.device) == (nproc, device), layout
    assert layout.message.startswith(f"make demo: {says}"), layout.message
    per_rank = ranks_of(layout)
    assert not missing_gpus(per_rank, count), per_rank
    assert per_rank == ([f"cuda:{r}" for r in range(nproc)] if device == "cuda" else ["cpu"] * nproc)


def test_the_rule_before_the_fix_asks_a_one_gpu_machine_for_cuda_1(gpus):
    # The twin: the Makefile started 2 ranks, and --device auto gave each cuda:LOCAL_RANK whenever
    # CUDA was available. On one GPU the same check must catch rank 1.
    gpus(1)
    old = [f"cuda:{r}" if torch.cuda.is_available() else "cpu" for r in range(2)]
    assert missing_gpus(old, torch.cuda.device_count()) == ["cuda:1"]
    assert not missing_gpus(ranks_of(devices.demo_layout()), torch.cuda.device_count())


def test_one_gpu_runs_one_rank_on_it_when_asked(gpus):
    gpus(1)
    layout = devices.demo_layout(nproc=1)
    assert (layout.nproc, layout.device, ranks_of(layout)) == (1, "cuda", ["cuda:0"])


def test_cuda_with_too_few_gpus_says_how_many_ranks_fit(gpus):
    gpus(1)
    with pytest.raises(InputError, match=r"2 local rank\(s\) and 1 GPU\(s\).*--nproc_per_node=1"):
        devices.rank_device("cuda", 1, 2)
    with pytest.raises(InputError, match="--nproc_per_node=1"):
        devices.demo_layout(nproc=2, device="cuda")
    gpus(0)
    with pytest.raises(InputError, match="no CUDA device is usable here"):
        devices.rank_device("cuda", 0, 1)


def test_cpu_is_cpu_whatever_the_gpus(gpus):
    gpus(4)
    assert devices.rank_device("cpu", 3, 4) == "cpu"
    assert devices.demo_layout(device="cpu") == devices.DemoLayout(
        2, "cpu", "make demo: 2 CPU rank(s) (gloo), as asked"
    )


def test_the_makefile_reads_the_layout_from_stdout_and_the_line_from_stderr(gpus, capsys):
    gpus(1)
    assert devices.main(["--nproc", "", "--device", "auto"]) == 0
    out, err = capsys.readouterr()
    assert out == "2 cpu\n"
    assert err.count("\n") == 1 and err.startswith("make demo: 2 CPU ranks (gloo)"), err
    assert devices.main(["--nproc", "0"]) == 2
    assert "DEMO_NPROC='0': give a number of ranks" in capsys.readouterr().err


def test_train_py_refuses_cuda_for_more_local_ranks_than_gpus(gpus, monkeypatch, capsys):
    gpus(1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "0")
    assert train_script.main(["--device", "cuda", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("train.py: error: --device cuda: 2 local rank(s) and 1 GPU(s)"), err


def test_the_demo_target_asks_for_the_layout():
    from pathlib import Path

    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    demo = makefile[makefile.index("\ndemo:") :].split("\n\n")[0]
    assert "-m examples.dlrm.devices" in demo and "--nproc_per_node=$$1" in demo and "--device $$2" in demo
    assert "--nproc_per_node=2" not in demo, demo
