"""Training that survives a lost rank: checkpoints without a drain, and the DLRM example killed and
restarted under torchrun.

Part 1 (2 gloo ranks, real all-to-alls): a checkpoint taken between two `progress()` calls, with
batches in flight and `pipe.dataloader_state(it)` of torchdata's StatefulDataLoader as the data
position, resumes in new processes bit-for-bit as the plain loop and as a drained checkpoint.

Part 2 (the DLRM example; the kills under torchrun, 2 CPU ranks, `--max-restarts=1`, the runs that
restart nothing on ranks forked in torchrun's environment): rank 1 is SIGKILLed at a step drawn at random
between two checkpoints (the seed is in the failure message); the job finishes, with the
uninterrupted plain loop's state digest (every parameter and optimizer state) and its losses at
every step after the resume point. Also: a kill in the middle of a save (resume loads the one
before), a resume onto one rank (resharded; with tables on disk, a clear error), and async saves.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import run_ranks, run_script, script_job

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]

# -- part 1: the no-drain checkpoint ----------------------------------------------------------

STEPS, AT = 10, 4
CASES = [
    ("TrainPipelineSparseDist", "table_wise"),
    ("TrainPipelineSparseDist", "column_wise"),
    ("PrefetchTrainPipelineSparseDist", "table_wise"),
]


def _loader(rank: int, state: dict | None = None):
    from torchdata.stateful_dataloader import StatefulDataLoader

    from tests import models

    loader = StatefulDataLoader(models.batches("dlrm", STEPS, rank), batch_size=None)
    if state is not None:
        loader.load_state_dict(state)
    return loader


def _path(out: str, pipe_name: str, sharding: str, rank: int, what: object) -> Path:
    return Path(out) / f"{pipe_name}-{sharding}-{what}-rank{rank}.pt"


def _save(rank: int, world_size: int, out: str) -> dict:
    import torch

    import pipeline
    from tests import models

    results = {}
    for pipe_name, sharding in CASES:
        fetched = {}
        for drained in (False, True):
            model, opt = models.build("dlrm", sharding)
            pipe = getattr(pipeline, pipe_name)(model, opt, torch.device("cpu"))
            it = iter(_loader(rank))
            outputs = [pipe.progress(it) for _ in range(AT)]
            if drained:
                outputs += pipe.drain(it)
                loader_state = it.state_dict()
            else:
                loader_state = pipe.dataloader_state(it)
            fetched[drained] = it.state_dict()["_num_yielded"]
            saved = {"model": model.state_dict(), "optimizer": opt.state_dict(), "loader": loader_state}
            # saved now: the state_dicts hold the live tensors, which training goes on changing
            torch.save({**saved, "outputs": outputs}, _path(out, pipe_name, sharding, rank, drained))
            if not drained:  # the same pipeline goes on: saving cost it nothing
                rest = models.run_to_end(pipe, it)
                final = {"outputs": outputs + rest, "model": model.state_dict()}
                torch.save(final, _path(out, pipe_name, sharding, rank, "uninterrupted"))
        results[(pipe_name, sharding)] = fetched
    return results


def _resume(rank: int, world_size: int, out: str) -> dict:
    import torch

    import pipeline
    from tests import models

    results = {}
    for pipe_name, sharding in CASES:
        ref_model, ref_opt = models.build("dlrm", sharding)
        expected = models.plain_loop(ref_model, ref_opt, models.batches("dlrm", STEPS, rank))
        saved = {
            key: torch.load(_path(out, pipe_name, sharding, rank, key), weights_only=False)
            for key in (False, True, "uninterrupted")
        }
        finals = {}
        for drained in (False, True):
            model, opt = models.build("dlrm", sharding, seed=7)  # other weights: the load must matter
            model.load_state_dict(saved[drained]["model"])
            opt.load_state_dict(saved[drained]["optimizer"])
            pipe = getattr(pipeline, pipe_name)(model, opt, torch.device("cpu"))
            rest = models.run_to_end(pipe, iter(_loader(rank, saved[drained]["loader"])))
            outputs = saved[drained]["outputs"] + rest
            finals[drained] = model.state_dict()
            results[(pipe_name, sharding, drained)] = {
                "count": len(outputs),
                "outputs_equal": models.bitwise_equal(expected, outputs),
                "params_equal": models.bitwise_equal(ref_model.state_dict(), model.state_dict()),
            }
        same = models.bitwise_equal(finals[False], finals[True])
        results[(pipe_name, sharding, "no_drain_vs_drained")] = same
        results[(pipe_name, sharding, "uninterrupted")] = models.bitwise_equal(
            expected, saved["uninterrupted"]["outputs"]
        ) and models.bitwise_equal(saved["uninterrupted"]["model"], finals[False])
    return results


@pytest.fixture(scope="module")
def no_drain(tmp_path_factory) -> tuple[list, list]:
    pytest.importorskip("torchdata", reason="torchdata (StatefulDataLoader) is not installed: make setup")
    out = str(tmp_path_factory.mktemp("no-drain"))
    return run_ranks(_save, 2, timeout=240, args=(out,)), run_ranks(_resume, 2, timeout=240, args=(out,))


@pytest.mark.parametrize(("pipe_name", "sharding"), CASES)
def test_checkpoint_without_drain_resumes_bit_for_bit(no_drain, pipe_name, sharding):
    saved, resumed = no_drain
    for rank in range(2):
        fetched = saved[rank][(pipe_name, sharding)]
        assert fetched[False] > AT, f"rank {rank}: no batch in flight at the checkpoint ({fetched})"
        for drained in (False, True):
            r = resumed[rank][(pipe_name, sharding, drained)]
            what = "drained" if drained else "no-drain"
            assert r["count"] == STEPS, f"rank {rank} {what}: {r}"
            assert r["outputs_equal"], f"rank {rank} {what}: outputs differ from the plain loop"
            assert r["params_equal"], f"rank {rank} {what}: parameters differ from the plain loop"
        assert resumed[rank][(pipe_name, sharding, "no_drain_vs_drained")], f"rank {rank}"
        assert resumed[rank][(pipe_name, sharding, "uninterrupted")], f"rank {rank}: saving changed the run"


def test_dataloader_state_without_state_dict_says_to_drain():
    from pipeline.ranks.protocol import resume_state

    with pytest.raises(TypeError, match=r"pipe\.drain\(iterator\)"):
        resume_state(iter([1, 2]), [])


# -- part 2: the DLRM example under torchrun --------------------------------------------------

EVERY, TOTAL = 4, 12
_FLAGS = ["--steps", str(TOTAL), "--batch-size", "64", "--num-embeddings", "400", "--no-progress"]


def _torchrun(
    tmp: Path,
    name: str,
    *flags: str,
    nproc: int = 2,
    restarts: int = 0,
    tiered: bool = False,
    forked: bool = False,
):
    """Run the example; returns (exit status, summary or None, {(rank, step): (attempt, loss)}, output).

    Under torchrun, or with `forked` on ranks forked in torchrun's environment (tests/harness.py
    run_script, which restarts a failed job as torchrun's agent does): they start in a second, where
    torchrun's workers import torch again.
    """
    run = tmp / name
    run.mkdir(exist_ok=True)
    extra = []
    if tiered:
        (tmp / f"{name}-store").mkdir(exist_ok=True)
        extra = ["--embedding-store", str(tmp / f"{name}-store"), "--cache-rows", "300"]
    argv = [*_FLAGS, *extra, *flags]
    argv += ["--summary-json", str(run / "summary.json"), "--loss-log", str(run / "losses.txt")]
    if forked:
        env = {"OMP_NUM_THREADS": "1"}
        job = script_job(
            run_script("examples.dlrm.train", argv, nproc, timeout=200, env=env, restarts=restarts)
        )
        status, output = job.returncode, job.stderr
    else:
        torchrun = Path(sys.executable).parent / "torchrun"
        cmd = [str(torchrun), "--standalone", f"--nproc_per_node={nproc}", f"--max-restarts={restarts}"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(var, None)
        proc = subprocess.run(
            [*cmd, "examples/dlrm/train.py", *argv],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        status, output = proc.returncode, proc.stdout + proc.stderr
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else None
    losses = {}
    if (run / "losses.txt").exists():
        for line in (run / "losses.txt").read_text().splitlines():
            rank, attempt, step, loss = line.split()[:4]
            if step.isdigit():  # later attempts overwrite earlier ones
                losses[(int(rank), int(step))] = (int(attempt), loss)
    return status, summary, losses, output


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The uninterrupted plain loop, per kernel: summary and losses."""
    tmp = tmp_path_factory.mktemp("reference")
    found = {}
    for kernel in ("fused", "tiered"):
        ckpt = tmp / f"{kernel}-ckpt"
        flags = ("--pipeline", "none", "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(EVERY))
        status, summary, losses, output = _torchrun(
            tmp, kernel, *flags, tiered=kernel == "tiered", forked=True
        )
        assert status == 0, output[-3000:]
        found[kernel] = {"summary": summary, "losses": losses, "ckpt": ckpt}
    return found


# Each pipeline and each kernel once, the prefetch pipeline with the kernel whose prefetch does work;
# the kill during a save runs Prefetch on the fused kernel. One run restarts under real torchrun (two
# torchrun start-ups are most of its time); the others on forked ranks that restart as its agent does.
@pytest.mark.parametrize(
    ("pipeline", "kernel", "launcher"),
    [("sparse-dist", "fused", "torchrun"), ("prefetch", "tiered", "forked")],
)
def test_killed_rank_restarts_and_finishes_bit_for_bit(tmp_path, reference, pipeline, kernel, launcher):
    seed = random.randrange(1 << 30)
    kill_at = random.Random(seed).randrange(EVERY + 1, 2 * EVERY)  # strictly between two checkpoints
    flags = ("--pipeline", pipeline, "--checkpoint-dir", str(tmp_path / "ckpt"))
    flags += ("--checkpoint-every", str(EVERY), "--inject-kill", f"1:step:{kill_at}")
    tiered = kernel == "tiered"
    forked = launcher == "forked"
    status, summary, losses, output = _torchrun(
        tmp_path, "run", *flags, restarts=1, tiered=tiered, forked=forked
    )
    where = f"(rank 1 killed after step {kill_at}, seed {seed})"
    assert status == 0, f"{where}\n{output[-4000:]}"
    assert "rank 1 dies after step" in output, where
    assert summary["resumed_from_step"] == EVERY, where
    ref = reference[kernel]
    assert summary["state_digest"] == ref["summary"]["state_digest"], f"{where}: final state differs"
    for rank in range(2):
        for step in range(EVERY + 1, TOTAL + 1):
            attempt, loss = losses[(rank, step)]
            assert attempt == 1, f"{where}: rank {rank} step {step} not rerun after the restart"
            assert loss == ref["losses"][(rank, step)][1], f"{where}: rank {rank} step {step} loss differs"


def test_kill_during_a_save_resumes_from_the_previous_checkpoint(tmp_path, reference):
    flags = ("--pipeline", "prefetch", "--checkpoint-dir", str(tmp_path / "ckpt"))
    flags += ("--checkpoint-every", str(EVERY), "--inject-kill", f"1:save:{2 * EVERY}")
    status, summary, _, output = _torchrun(tmp_path, "run", *flags, restarts=1, forked=True)
    assert status == 0, output[-4000:]
    assert f"rank 1 dies while saving the checkpoint of step {2 * EVERY}" in output
    assert summary["resumed_from_step"] == EVERY  # not the half-written one
    assert summary["state_digest"] == reference["fused"]["summary"]["state_digest"]


def test_resume_onto_one_rank(tmp_path, reference):
    import shutil

    for kernel in ("fused", "tiered"):
        ckpt = tmp_path / f"{kernel}-ckpt"
        shutil.copytree(reference[kernel]["ckpt"], ckpt)
        shutil.rmtree(ckpt / f"step-{TOTAL:09d}")  # resume from step 8: 4 steps left to train
        flags = ("--pipeline", "sparse-dist", "--checkpoint-dir", str(ckpt))
        status, summary, _, output = _torchrun(
            tmp_path, kernel, *flags, nproc=1, tiered=kernel == "tiered", forked=True
        )
        if kernel == "fused":  # the tables' shards are resharded onto the one rank by DCP
            assert status == 0, output[-4000:]
            assert summary["resumed_from_step"] == 2 * EVERY and summary["steps"] == TOTAL - 2 * EVERY
        else:
            assert status != 0
            assert "train.py: error: " in output and "resume only onto the same world size" in output
            assert f'File "{ROOT / "examples"}' not in output, output[-4000:]  # no traceback of ours


# -- the example's data position ----------------------------------------------------------------


@pytest.mark.parametrize("data", [None, str(ROOT / "tests" / "fixtures" / "criteo_tiny.tsv")])
def test_data_position_resumes_the_same_batches(data):
    import torch

    from examples.dlrm.config import TrainConfig
    from examples.dlrm.data import make_sources

    config = TrainConfig(steps=5, batch_size=8, num_embeddings=(10_000,), data=data)
    sources = make_sources(config, rank=1, world_size=2)
    whole = sources.train(0, 0)
    first = [next(whole) for _ in range(2)]
    state = whole.state_dict()
    assert state == {"epoch": 0, "batch": 2} and len(first) == 2
    rest, resumed = list(whole), sources.train(state["epoch"], state["batch"])
    again = list(resumed)
    assert len(rest) == len(again) == 3
    for a, b in zip(rest, again, strict=True):
        assert torch.equal(a.dense_features, b.dense_features)
        assert torch.equal(a.sparse_features.values(), b.sparse_features.values())
    assert resumed.state_dict() == {"epoch": 0, "batch": 5}


def test_async_checkpoints_are_committed_and_change_nothing(tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    flags = ("--pipeline", "prefetch", "--checkpoint-dir", str(ckpt), "--checkpoint-async")
    status, summary, _, output = _torchrun(
        tmp_path, "run", *flags, "--checkpoint-every", str(EVERY), forked=True
    )
    assert status == 0, output[-4000:]
    assert summary["state_digest"] == reference["fused"]["summary"]["state_digest"]
    assert sorted(p.name for p in ckpt.iterdir()) == [f"step-{2 * EVERY:09d}", f"step-{TOTAL:09d}"]
