"""examples/dlrm: every --pipeline value trains like the plain loop on 2 ranks, the TSV reader reads
the fixture, bad input fails with one clear paragraph, and the torchrun entry point runs.

tests/fixtures/criteo_tiny.tsv was written by
`python examples/dlrm/train.py --write-tsv tests/fixtures/criteo_tiny.tsv --lines 48 --seed 0
--num-embeddings 10000` (missing rate 0.1); `_FIXTURE_SPEC` must match that command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from examples.dlrm import train as train_script
from examples.dlrm.config import InputError, TrainConfig
from examples.dlrm.criteo_tsv import resolve_paths, tsv_batches
from examples.dlrm.loop import train
from examples.dlrm.runners import PIPELINE_CLASSES
from examples.dlrm.synthetic import SyntheticSpec, synthetic_batches
from tests.harness import pytest_timeout, run_script, script_job

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "criteo_tiny.tsv"
_FIXTURE_SPEC = SyntheticSpec(table_sizes=(10_000,) * 26, missing_rate=0.1, seed=0)
_STEPS = 6
_TIMEOUT = 150
pytestmark = [pytest.mark.timeout(pytest_timeout(_TIMEOUT)), pytest.mark.slow]


def _config(pipeline: str, **overrides) -> TrainConfig:
    base = dict(
        pipeline=pipeline,
        steps=_STEPS,
        batch_size=64,
        num_embeddings=(500,),
        eval_batches=2,
        log_every=3,
        show_progress=False,
    )
    return TrainConfig(**{**base, **overrides})


def _variant(rank: int, world_size: int, name: str) -> dict:
    """`--pipeline name` with an eval pass every 2 steps (and, for "none", without: the reference
    for what eval must not change)."""
    device = torch.device("cpu")
    result = {}
    if name == "none":
        result["losses"] = train(_config(name), rank=rank, world_size=world_size, device=device).losses
    evaluated = train(_config(name, eval_every=2), rank=rank, world_size=world_size, device=device)
    result.update(losses_with_eval=evaluated.losses, eval_losses=evaluated.eval_losses)
    return result


def _learning(rank: int, world_size: int) -> list[float]:
    long_run = _config("none", steps=40, batch_size=128, log_every=40, lr=0.1)
    return train(long_run, rank=rank, world_size=world_size, device=torch.device("cpu")).losses


@pytest.fixture(scope="module")
def reference(pool) -> list[dict]:
    """The plain loop's run on each rank."""
    return pool.run(_variant, "none", timeout=_TIMEOUT)


def test_plain_loop_trains_on_two_ranks(pool, reference):
    learning = pool.run(_learning, timeout=_TIMEOUT)
    for rank in range(2):
        ref = reference[rank]
        assert len(ref["losses"]) == _STEPS
        # An eval pass between steps must not change training.
        assert ref["losses_with_eval"] == ref["losses"]
        # eval after steps 2, 4, 6, two batches each
        assert [len(p) for p in ref["eval_losses"]] == [2, 2, 2]
        # ... on the same eval batches, so a changing loss means the model changed.
        assert ref["eval_losses"][0] != ref["eval_losses"][-1]
        assert sum(learning[rank][-10:]) < sum(learning[rank][:10]) - 0.5, learning[rank]
    # Ranks read different data.
    assert reference[0]["losses"] != reference[1]["losses"]


@pytest.mark.parametrize("name", list(PIPELINE_CLASSES))
def test_pipeline_matches_plain_loop(pool, reference, name):
    for rank, got in enumerate(pool.run(_variant, name, timeout=_TIMEOUT)):
        assert got["losses_with_eval"] == reference[rank]["losses"], f"rank {rank} training losses"
        assert got["eval_losses"] == reference[rank]["eval_losses"], f"rank {rank} eval losses"


def test_tsv_reader_reads_the_fixture_as_generated():
    (batch,) = tsv_batches(
        resolve_paths(str(FIXTURE)),
        table_sizes=_FIXTURE_SPEC.table_sizes,
        batch_size=48,
        rank=0,
        world_size=1,
    )
    (expected,) = synthetic_batches(_FIXTURE_SPEC, batch_size=48, num_batches=1, rank=0)
    assert batch.dense_features.shape == (48, 13)
    assert torch.equal(batch.dense_features, expected.dense_features)
    assert torch.equal(batch.labels, expected.labels)
    assert batch.sparse_features.keys() == expected.sparse_features.keys()
    assert torch.equal(batch.sparse_features.lengths(), expected.sparse_features.lengths())
    assert torch.equal(batch.sparse_features.values(), expected.sparse_features.values())
    # The fixture has empty fields, which read as no id.
    assert 0 < int((batch.sparse_features.lengths() == 0).sum()) < 48 * 26


def test_tsv_ranks_read_disjoint_shares():
    def read(rank: int, world_size: int, batch_size: int):
        return list(
            tsv_batches(
                [FIXTURE],
                table_sizes=(97,) * 26,
                batch_size=batch_size,
                rank=rank,
                world_size=world_size,
            )
        )

    whole = read(0, 1, 10)  # 4 batches of 10 lines; the last 8 lines make no full batch
    shares = [read(r, 2, 5) for r in range(2)]
    assert len(whole) == len(shares[0]) == len(shares[1]) == 4
    for j, batch in enumerate(whole):
        joined = torch.cat([shares[0][j].dense_features, shares[1][j].dense_features])
        assert torch.equal(joined, batch.dense_features)
        assert torch.equal(torch.cat([s[j].labels for s in shares]), batch.labels)


def test_missing_data_file_is_one_clear_error(tmp_path, capsys):
    missing = tmp_path / "nope.tsv"
    assert train_script.main(["--data", str(missing), "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("train.py: error:") and str(missing) in err
    assert "Traceback" not in err
    with pytest.raises(InputError, match="no data file matches"):
        resolve_paths(str(tmp_path / "*.tsv"))
    with pytest.raises(InputError, match="not a file"):
        resolve_paths(str(tmp_path))


def test_wrong_column_count_names_file_and_line(tmp_path):
    lines = FIXTURE.read_text().splitlines(keepends=True)
    lines[4] = lines[4].split("\t", 1)[1]  # line 5 loses its label column
    bad = tmp_path / "bad.tsv"
    bad.write_text("".join(lines))
    with pytest.raises(InputError, match=r"bad\.tsv:5: expected 40 tab-separated columns.*39"):
        list(tsv_batches([bad], table_sizes=(97,) * 26, batch_size=4, rank=1, world_size=2))


def test_malformed_value_names_file_and_line(tmp_path):
    lines = FIXTURE.read_text().splitlines(keepends=True)
    lines[2] = "7" + lines[2][1:]  # label 7
    bad = tmp_path / "bad.tsv"
    bad.write_text("".join(lines))
    with pytest.raises(InputError, match=r"bad\.tsv:3: malformed field: label 7"):
        list(tsv_batches([bad], table_sizes=(97,) * 26, batch_size=4, rank=0, world_size=1))


def test_batch_size_must_divide_by_world_size(monkeypatch, capsys):
    with pytest.raises(InputError, match="divisible by the world size"):
        TrainConfig(batch_size=255).local_batch_size(2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert train_script.main(["--batch-size", "255", "--pipeline", "none"]) == 2
    err = capsys.readouterr().err
    assert "255 samples do not split evenly over 2 ranks" in err and "Traceback" not in err
    with pytest.raises(InputError, match="--batch-size must be a positive"):
        TrainConfig(batch_size=0)


def test_unknown_pipeline_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        train_script.main(["--pipeline", "fast"])
    assert info.value.code == 2
    assert "invalid choice: 'fast'" in capsys.readouterr().err


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("case", ["mixed", "scores-on-thresholds", "one-label", "several-updates"])
def test_the_examples_auc_is_torchmetrics_binned_auroc_bit_for_bit(case):
    """The example computes its AUC itself (importing torchmetrics would import matplotlib, which
    writes under HOME): the same value as torchmetrics' `BinaryAUROC(thresholds=200)`, to the bit."""
    from torchmetrics.classification import BinaryAUROC

    from examples.dlrm.report import BinnedAUC

    gen = torch.Generator().manual_seed(len(case))
    ours, theirs = BinnedAUC(torch.device("cpu")), BinaryAUROC(thresholds=200, validate_args=False)
    for _ in range(3 if case == "several-updates" else 1):
        logits = torch.randn(2000, generator=gen) * 2
        scores = torch.sigmoid(logits)
        if case == "scores-on-thresholds":  # a score equal to a threshold counts at or above it
            scores = torch.linspace(0, 1, 200)[torch.randint(0, 200, (2000,), generator=gen)]
        labels = (torch.rand(2000, generator=gen) < torch.sigmoid(logits)).float()
        if case == "one-label":
            labels = torch.ones(2000)
        ours.update(scores, labels)
        theirs.update(scores, labels)
    expected = theirs.compute()
    assert torch.equal(ours.compute(), expected), (ours.compute(), expected)
    ours.reset()
    ours.update(torch.tensor([0.2, 0.8]), torch.tensor([0.0, 1.0]))
    assert float(ours.compute()) == 1.0, "reset left the earlier scores in"


def test_malformed_line_through_the_script_exits_2_without_traceback(tmp_path):
    lines = FIXTURE.read_text().splitlines(keepends=True)
    lines[30] = "\t".join(lines[30].split("\t")[:20]) + "\n"
    bad = tmp_path / "bad.tsv"
    bad.write_text("".join(lines))
    proc = _forked(
        ["--pipeline", "none", "--no-progress", "--data", str(bad), "--batch-size", "8", "--steps", "0"]
    )
    assert proc.returncode == 2, proc.stderr
    assert f"{bad}:31: expected 40 tab-separated columns" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_torchrun_entry_point_prints_the_summary(tmp_path):
    summary = tmp_path / "summary.json"
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--standalone", "--nproc_per_node=2", "examples/dlrm/train.py"]
    flags = ["--pipeline", "none", "--steps", "3", "--batch-size", "64", "--eval-every", "3"]
    proc = _run([*cmd, *flags, "--summary-json", str(summary)], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "summary" in proc.stdout and "samples_per_second" in proc.stdout
    assert "eval after step 3 | loss" in proc.stdout
    written = json.loads(summary.read_text())
    assert written["steps"] == 3 and written["world_size"] == 2 and written["eval_passes"] == 1
    assert 0 < written["train_loss"] < 5 and written["samples_per_second"] > 0


def _run_on_disk(rank: int, world_size: int, store: str) -> dict:
    device = torch.device("cpu")
    results: dict = {}
    for name in ("none", "prefetch"):
        # 2000 rows per table, 150 cached: batches of 32 ids per rank evict every step.
        config = _config(name, num_embeddings=(2000,), embedding_store=store, cache_rows=150)
        run = train(config, rank=rank, world_size=world_size, device=device)
        results[name] = {"losses": run.losses, "summary": run.summary}
    too_small = _config("none", num_embeddings=(2000,), embedding_store=store, cache_rows=8)
    try:
        train(too_small, rank=rank, world_size=world_size, device=device)
    except InputError as e:
        results["too_small"] = str(e)
    return results


@pytest.fixture(scope="module")
def on_disk(pool, tmp_path_factory) -> tuple[list[dict], Path]:
    store = tmp_path_factory.mktemp("store")
    return pool.run(_run_on_disk, str(store), timeout=_TIMEOUT), store


def test_embedding_store_trains_like_the_plain_loop_and_reports_the_cache(on_disk):
    results, store = on_disk
    for rank in range(2):
        plain, prefetch = results[rank]["none"], results[rank]["prefetch"]
        assert len(plain["losses"]) == _STEPS
        # The kernel is exact whatever the cache holds: the pipeline only moves the loads.
        assert prefetch["losses"] == plain["losses"], f"rank {rank}"
        for summary in (plain["summary"], prefetch["summary"]):
            assert "customized_kernel" in summary["sharding"]
            assert 0 < summary["cache_hit_rate"] < 1, summary  # evicting, yet re-using rows
            # every step misses the cache, so every step reads rows from the files
            assert summary["prefetch_ms"] > 0 and summary["store_read_ms"] > 0, summary
    # One file per table shard, none left half-written (the too-small run wrote none either).
    files = sorted(p.name for p in store.iterdir())
    assert len(files) == 26 and all(f.endswith(".rows") for f in files), files


def test_cache_smaller_than_a_batch_is_one_clear_error(on_disk):
    results, _ = on_disk
    for rank in range(2):
        message = results[rank]["too_small"]
        # train() is called without train.py's preflight check: the kernel's error, translated
        assert message.startswith("--cache-rows 8 is too small: "), message
        assert "Use --cache-rows 64 or more" in message and "\n" not in message


def test_embedding_store_flags_are_checked_before_training(tmp_path, monkeypatch, capsys):
    def error(argv: list[str]) -> str:
        assert train_script.main(["--pipeline", "none", "--steps", "2", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("train.py: error:") and "Traceback" not in err
        assert err.count("\n") == 1, err
        return err

    missing = tmp_path / "missing"
    assert "does not exist; create it" in error(["--embedding-store", str(missing), "--cache-rows", "64"])
    afile = tmp_path / "file"
    afile.write_text("")
    assert "is not a directory" in error(["--embedding-store", str(afile), "--cache-rows", "64"])
    assert "go together" in error(["--embedding-store", str(tmp_path)])
    assert "--cache-rows must be a positive" in error(
        ["--embedding-store", str(tmp_path), "--cache-rows", "0"]
    )
    # As root every directory is writable: the check itself is what this exercises.
    monkeypatch.setattr(os, "access", lambda *args: False)
    assert "is not writable" in error(["--embedding-store", str(tmp_path), "--cache-rows", "64"])
    assert list(tmp_path.iterdir()) == [afile]


def _store_errors(tmp: Path, *extra: str) -> subprocess.CompletedProcess:
    flags = ["--pipeline", "none", "--no-progress", "--steps", "2", "--batch-size", "32"]
    return _forked([*flags, "--embedding-store", str(tmp), "--cache-rows", "64", *extra])


def _forked(argv: list[str]) -> subprocess.CompletedProcess:
    """The script's `main(argv)` as one rank forked in torchrun's environment (tests/harness.py
    run_script): its status, and its stdout and stderr together as `stderr`."""
    return script_job(run_script("examples.dlrm.train", argv, 1, timeout=90, env={"OMP_NUM_THREADS": "1"}))


def test_store_of_another_shape_or_none_to_open_is_one_clear_error(tmp_path):
    made = _store_errors(tmp_path, "--num-embeddings", "300")
    assert made.returncode == 0, made.stderr
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    for mode in ("open", "create"):
        proc = _store_errors(tmp_path, "--num-embeddings", "400", "--store-mode", mode)
        assert proc.returncode == 2, proc.stderr
        assert "was made for another table shape" in proc.stderr
        assert "delete it or pick another" in proc.stderr
        assert "Traceback" not in proc.stderr and proc.stderr.count("train.py: error") == 1
    # The refused stores were neither replaced nor joined by half-written ones.
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = _store_errors(empty, "--store-mode", "open")
    assert proc.returncode == 2 and "no embedding store at" in proc.stderr
    assert "--store-mode create" in proc.stderr and not list(empty.iterdir())
