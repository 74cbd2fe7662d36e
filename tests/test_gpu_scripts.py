"""The CPU side of the GPU scripts (scripts/gpu/): the pins they stage, the fatbin pruning on a small
synthetic ELF, the steps and arguments of run.sh and stage.sh, the device sequence's dry run and its budget
against the README's, the speed sequence's configs (their shapes, and each run through the benchmark's
worker at a reduced size) and its `make demo`, and the GPU cases, the sanitizer's and the memory
script's code paths run on CPU (`tests/cuda_cases.py` on RecordingStreams)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cuda_cases import CLASSES, HOST_ONLY
from tests.harness import pytest_timeout

pytestmark = pytest.mark.slow  # dry runs on 2 gloo ranks and subprocess scripts

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "scripts" / "gpu"
sys.path.insert(0, str(GPU))

import pins  # noqa: E402  (scripts/gpu is no package)
import prune_fatbin  # noqa: E402

TIMEOUT = 150
STACKS = """
TORCHREC ?= 1.9
STACK_1.9 := 2.14.1 1.9.0 1.9.2
STACK_1.8 := 2.13.0 1.8.0 1.8.0
TORCH_PIN := torch==$(word 1,$(STACK))
"""
FBGEMM_INIT = """
_fbgemm_torch_compat_table = {
    "1.9": "2.14",
    "1.8": "2.13",
    "1.6": "2.11",
}
"""


def test_pins_of_this_makefile_are_one_stack():
    found = pins.read_pins((ROOT / "Makefile").read_text())
    assert found.torch and found.fbgemm and found.torchrec, found
    assert found.fbgemm.split(".")[:2] == found.torchrec.split(".")[:2], "fbgemm and torchrec of one release"


def test_pins_of_a_makefile_of_stacks():
    assert pins.read_pins(STACKS) == pins.Pins("2.14.1", "1.9.0", "1.9.2", stack="1.9"), "the default stack"
    assert pins.read_pins(STACKS, "1.8").torch == "2.13.0", "--stack 1.8"
    with pytest.raises(pins.PinsError, match=r"stack '2.0' is not in the Makefile; it has \['1.8', '1.9'\]"):
        pins.read_pins(STACKS, "2.0")


def test_pins_missing_say_what_is_expected():
    with pytest.raises(pins.PinsError, match=r"cannot read TORCH_PIN .* expected torch==X\.Y\.Z"):
        pins.read_pins("FBGEMM_cuda := fbgemm-gpu==1.8.0\n")
    with pytest.raises(pins.PinsError, match="drop --stack"):
        pins.read_pins("TORCH_PIN := torch==2.13.0\n", "1.9")


def test_fbgemms_table_names_its_torch_and_the_fbgemm_of_a_torch():
    assert pins.torch_for_fbgemm(FBGEMM_INIT, "1.9.0") == "2.14"
    assert pins.fbgemm_for_torch(FBGEMM_INIT, "2.11.0+cu130") == "1.6", "the image's torch"
    with pytest.raises(pins.PinsError, match=r"no entry for 1\.7\.0"):
        pins.torch_for_fbgemm(FBGEMM_INIT, "1.7.0")
    with pytest.raises(pins.PinsError, match="no _fbgemm_torch_compat_table"):
        pins.torch_for_fbgemm("import torch\n", "1.9.0")


def test_pins_cli_prints_shell_assignments():
    out = subprocess.run(
        [sys.executable, str(GPU / "pins.py"), "--format", "shell"], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.startswith("TORCH="), out.stderr


def _entry(kind: int, arch: int, payload: bytes) -> bytes:
    header = struct.pack("<HHIQ", kind, 0x0101, 64, len(payload)).ljust(28, b"\0") + struct.pack("<I", arch)
    return header.ljust(64, b"\0") + payload


def _synthetic_so(tmp: Path) -> tuple[Path, dict[int, bytes]]:
    """A relocatable ELF (gcc, objcopy) whose .nv_fatbin holds sm_80, sm_90 and PTX 90 entries."""
    if not all(shutil.which(t) for t in ("gcc", "objcopy", "readelf")):
        pytest.skip("needs gcc, objcopy and readelf (binutils)")
    payloads = {80: b"\x80" * 256, 90: b"\x90" * 128}
    entries = _entry(2, 80, payloads[80]) + _entry(2, 90, payloads[90]) + _entry(1, 90, b"ptx\0" * 8)
    blob = struct.pack("<IHHQ", prune_fatbin.MAGIC, 1, 16, len(entries)) + entries
    (tmp / "fatbin.bin").write_bytes(blob)
    (tmp / "k.c").write_text("int k(void) { return 1; }\n")
    subprocess.run(["gcc", "-c", "-o", str(tmp / "k.o"), str(tmp / "k.c")], check=True)
    subprocess.run(
        ["objcopy", "--add-section", f".nv_fatbin={tmp / 'fatbin.bin'}", str(tmp / "k.o"), str(tmp / "k.so")],
        check=True,
    )
    return tmp / "k.so", payloads


def test_prune_zeroes_other_architectures_only(tmp_path, capsys):
    so, payloads = _synthetic_so(tmp_path)
    size = so.stat().st_size
    assert prune_fatbin.main(["list", "90", str(so)]) == 0
    assert "sm_80 0.0 MB, sm_90 0.0 MB" in capsys.readouterr().out, "the entries were not found"
    assert prune_fatbin.main(["prune", "90", str(so)]) == 0
    data = so.read_bytes()
    assert so.stat().st_size == size, "pruning changed the file's size"
    assert payloads[90] in data, "the kept architecture's code was touched"
    assert payloads[80] not in data and data.count(b"ptx\0") == 8, "sm_80 kept, or the PTX of sm_90 lost"


def test_prune_refuses_bad_arguments(capsys):
    assert prune_fatbin.main(["shrink", "90"]) == 2
    assert "prune_fatbin.py prune 90" in capsys.readouterr().err, "no usage on bad arguments"


def _sh(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(GPU / script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PY": sys.executable, **env},
        timeout=60,
    )


def test_run_sh_names_its_steps_and_refuses_others():
    bad = _sh("run.sh", "tests", "nope")
    assert bad.returncode == 2 and "unknown step 'nope'" in bad.stderr, bad
    assert _sh("run.sh").returncode == 2, "no step named: usage and exit 2"
    assert "memory    peak memory" in _sh("run.sh", "--help").stdout


def test_run_sh_dry_run_prints_each_steps_command(tmp_path):
    dry = _sh("run.sh", "probe", "tests", "csan", "memory", "bench", DRY="1", OUT=str(tmp_path))
    assert dry.returncode == 0, dry.stderr
    for command in (
        "pytest -q -p no:cacheprovider tests/test_cuda.py",
        "scripts/gpu/csan.py",
        "scripts/gpu/memory.py --config gpu-large",
        "benchmarks run --device cuda",
    ):
        assert command in dry.stdout, f"{command!r} not in the dry run:\n{dry.stdout}"


def test_run_sh_install_without_the_wheels_says_what_to_carry(tmp_path):
    out = _sh("run.sh", "install", DRY="1", OUT=str(tmp_path), GPU_DIR=str(tmp_path / "none"))
    assert out.returncode == 1 and "install: carry" in out.stderr, out


def test_stage_sh_reads_the_pins_and_its_arguments(tmp_path):
    (tmp_path / "Makefile").write_text(STACKS)
    dry = _sh("stage.sh", "--image-torch", "2.11.0", "--dry-run", MAKEFILE=str(tmp_path / "Makefile"))
    assert dry.returncode == 0, dry
    said = "pins: torch=2.14.1 fbgemm=1.9.0 torchrec=1.9.2; image torch 2.11.0: fbgemm-gpu~=1.6.0"
    assert said in dry.stdout, dry
    bad = _sh("stage.sh", "--frobnicate")
    assert bad.returncode == 2 and "unknown argument --frobnicate" in bad.stderr, bad


def _staged(tmp: Path, parts: int = 2) -> Path:
    """What stage.sh writes, in small: `parts` parts, a torchrec wheel and stack.env."""
    gpu = tmp / "gpu"
    for i in range(1, parts + 1):
        (gpu / f"p{i}").mkdir(parents=True)
        (gpu / f"p{i}" / f"part.aa{i}").write_bytes(b"x" * 1000)
    (gpu / "whl").mkdir()
    (gpu / "whl" / "torchrec-1.6.1-py312-none-any.whl").write_bytes(b"")
    env = f"TORCH=2.11.0 FBGEMM=1.6.0 TORCHREC=1.6.1\nNEEDS=2.11 PARTS={parts}\n"
    (gpu / "whl" / "stack.env").write_text(env)
    return gpu


def test_the_sequence_dry_runs_every_call_on_cpu(tmp_path):
    gpu = _staged(tmp_path)
    dry = _sh("run.sh", "sequence", DRY="1", OUT=str(tmp_path), GPU_DIR=str(gpu))
    assert dry.returncode == 0, dry.stderr
    assert f'call 1 of 2, timeout_s 600, carry ["{gpu}/p1"]' in dry.stdout, dry.stdout
    assert f'call 2 of 2, timeout_s 600, carry ["{gpu}/p2", "{gpu}/whl"]' in dry.stdout, dry.stdout
    for command in (
        f"cp {gpu}/p1/part.aa1 /tmp/gpu-parts/",
        "xz -d -T0",
        "tests/test_cuda.py",
        "scripts/gpu/csan.py",
        "scripts/gpu/memory.py --config gpu-large",
    ):
        assert command in dry.stdout, f"{command!r} not in the dry run:\n{dry.stdout}"
    at = [dry.stdout.index(step) for step in ("tests/test_cuda.py", "csan.py", "memory.py")]
    assert at == sorted(at), "the tests, then the sanitizer, then the memory table"
    assert "device time: start 60 s + steps + 30 s a call" in dry.stdout, dry.stdout


def test_the_sequence_dry_run_refuses_a_missing_part_a_large_carry_and_an_overrun(tmp_path):
    gpu = _staged(tmp_path, parts=3)
    (gpu / "p2" / "part.aa2").unlink()
    out = _sh("run.sh", "sequence", DRY="1", OUT=str(tmp_path), GPU_DIR=str(gpu))
    assert out.returncode == 1 and f"{gpu}/p2 has no part" in out.stderr, out
    with open(gpu / "p2" / "part.aa2", "wb") as f:
        f.truncate(64 << 20)  # sparse: du -b counts its 64 MiB
    out = _sh("run.sh", "sequence", DRY="1", OUT=str(tmp_path), GPU_DIR=str(gpu))
    assert out.returncode == 1 and "call 2 carries" in out.stderr and "over 64 MiB" in out.stderr, out
    gpu = _staged(tmp_path / "b")
    out = _sh("run.sh", "sequence", DRY="1", OUT=str(tmp_path), GPU_DIR=str(gpu), DEVICE_S="600")
    assert out.returncode == 1 and "over the 600 s of device time" in out.stderr, out
    not_dry = _sh("run.sh", "sequence", OUT=str(tmp_path), RESULTS=str(tmp_path / "results"))
    assert not_dry.returncode == 1, "not dry: the sequence spans calls"


def test_the_speed_sequence_dry_runs_every_call_on_cpu(tmp_path):
    """The speed sequence's calls: the tests, gpu-busy, the hand-offs, `make demo` on one GPU, then
    gpu-uvm-big, the slowest, last (cut first if the call runs late), each step at its budget and the
    last at what the others left; the benchmarks compare our SparseDist and Prefetch with torchrec's
    and the plain loop; 710 s of device time."""
    gpu = _staged(tmp_path)
    dry = _sh("run.sh", "speed-sequence", DRY="1", OUT=str(tmp_path), GPU_DIR=str(gpu))
    assert dry.returncode == 0, dry.stderr
    assert f'call 1 of 2, timeout_s 600, carry ["{gpu}/p1"] ' in dry.stdout, dry.stdout
    call_2 = f'call 2 of 2, timeout_s 600, carry ["{gpu}/p2", "{gpu}/whl"]'
    assert call_2 in dry.stdout, dry.stdout
    assert "run.sh receive install probe tests speed handoffs demo speed-uvm  (steps 570 s)" in dry.stdout
    handoffs = "--classes TrainPipelineBase TrainPipelineFusedSparseDist TrainPipelineSemiSync"
    steps = (
        "tests/test_cuda.py --run-first [StagedTrainPipeline+prefetch-dlrm-table_wise]",
        "benchmarks run --device cuda --world-size 1",
        "--configs gpu-busy",
        f"memory.py --config gpu-large --steps 10 {handoffs}",
        "make -o setup demo DEMO_NPROC=1",
        "--configs gpu-uvm-big",
    )
    at = [dry.stdout.find(step) for step in steps]
    assert -1 not in at and at == sorted(at), f"not in this order: {steps}\n{dry.stdout}"
    budgets = (("tests", 120), ("speed", 120), ("handoffs", 45), ("demo", 45), ("speed-uvm", 120))
    for step, seconds in budgets:
        assert f"== {step} ({seconds} s)" in dry.stdout, f"{step} not given {seconds} s:\n{dry.stdout}"
    assert "csan.py" not in dry.stdout.split(call_2)[1], "the sanitizer is the checks' sequence's"
    variants = ("plain", "ours-sparse-dist", "ours-prefetch", "torchrec-sparse-dist", "torchrec-prefetch")
    for config in ("gpu-busy", "gpu-uvm-big"):
        command = _speed_command(dry.stdout, config)
        assert all(v in command for v in variants), command
        assert f"--json {tmp_path}/results/speed_{config}.json" in dry.stdout, "the JSON goes to the results"
    assert "device time: start 60 s + steps + 30 s a call = 710 s of 780" in dry.stdout, dry.stdout


def test_a_sequence_over_13_minutes_or_a_step_cut_short_is_refused(tmp_path):
    """The negative twins of the budget: the speed sequence at 780 s passes and at 781 s fails, even
    where DEVICE_S allows more; a step before the last that the call's limit would cut fails."""
    gpu = _staged(tmp_path)
    run = {"DRY": "1", "OUT": str(tmp_path), "GPU_DIR": str(gpu), "DEVICE_S": "900"}
    at_780 = _sh("run.sh", "speed-sequence", **run, START_S="130")
    assert at_780.returncode == 0 and "= 780 s of 900" in at_780.stdout, at_780.stderr
    at_781 = _sh("run.sh", "speed-sequence", **run, START_S="131")
    assert at_781.returncode == 1 and "781 s is over 13 minutes (780 s)" in at_781.stderr, at_781.stderr
    cut = _sh("run.sh", "speed-sequence", **run, CALL_S="300")  # each call's steps end by 300 s
    assert cut.returncode == 1 and "speed would be cut to 60 of its 120 s" in cut.stderr, cut.stderr


def _speed_command(dry: str, config: str) -> list[str]:
    """The benchmark command of `config` in a dry run, from `python3` on."""
    line = next(ln for ln in dry.splitlines() if "-m benchmarks run" in ln and f"--configs {config} " in ln)
    return line[line.index("python3 ") :].split()


def test_the_speed_steps_commands_are_the_scripts_own(tmp_path):
    """The benchmark's command line is one `python -m benchmarks run` accepts (its flags listed by
    --help, the spec valid: on CPU it stops at the missing GPU); the example's, one train.py accepts
    (it stops at the same point)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks that the commands stop at the missing GPU")
    dry = _sh("run.sh", "speed", "speed-uvm", "example", DRY="1", OUT=str(tmp_path)).stdout
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    usage = subprocess.run(
        [sys.executable, "-m", "benchmarks", "run", "--help"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    for config in ("gpu-busy", "gpu-uvm-big"):
        command = _speed_command(dry, config)
        for flag in (word for word in command if word.startswith("--")):
            assert flag in usage, f"{flag} is not among `benchmarks run --help`'s options"
        done = subprocess.run(
            [sys.executable, *command[1:]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
        )
        stopped = done.returncode == 2 and "--device cuda needs a GPU per rank" in done.stderr
        assert stopped, done.stderr[-2000:]
    line = next(ln for ln in dry.splitlines() if "examples/dlrm/train.py" in ln)
    argv = line[line.index("examples/") :].split()
    done = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "--device cuda: no CUDA device" in done.stderr, done.stderr[-2000:]


def _run_sh_words(name: str) -> list[str]:
    """The words of run.sh's `NAME="..."` line (SPEED_VARIANTS, SPEED_BUSY, SPEED_UVM)."""
    return re.search(rf'^{name}="([^"]+)"', (GPU / "run.sh").read_text(), re.M).group(1).split()


def _speed_flags(name: str) -> dict[str, str]:
    """A speed step's benchmark flags in run.sh (`--configs`, `--rounds`, ...), each with its value."""
    words = _run_sh_words(name)
    return dict(zip(words[::2], words[1::2], strict=True))


def test_the_speed_configs_are_a_busy_gpu_and_tables_beyond_it():
    """gpu-busy, the `speed` step's config, has the shape the README's arithmetic puts at 20 ms or more
    a plain step on an H100 (batch 16,384, 26 tables, tens of millions of rows in HBM); gpu-uvm-big,
    `speed-uvm`'s,
    has tens of GB of rows behind a cache of a few %, more than the GPU memory its process may
    allocate, and few enough for host memory. The README gives the floor; the twins below fail the
    same checks."""
    from benchmarks.configs import get_config, table_bytes
    from benchmarks.models import memory_fraction

    busy, big = (get_config(_speed_flags(name)["--configs"]) for name in ("SPEED_BUSY", "SPEED_UVM"))
    assert (busy.name, big.name) == ("gpu-busy", "gpu-uvm-big")
    assert busy.batch_size >= 16_384 and busy.num_tables == 26 and busy.cache_fraction is None, busy
    assert busy.num_tables * busy.num_embeddings >= 20_000_000, "tens of millions of rows"
    large = get_config("gpu-large")  # the twin: host-bound on an H100 (a 5.6 ms plain step)
    assert large.batch_size < 16_384 and large.num_tables * large.num_embeddings < 20_000_000, large

    rows, cap = table_bytes(big), big.gpu_memory_gib * 2**30
    assert 20e9 <= rows <= 45e9, f"{rows / 1e9:.1f} GB: not tens of GB, or two models over 90 GB of host"
    assert big.cache_fraction <= 0.1 and rows > cap, "a few % cached; rows the capped GPU could not hold"
    assert big.cache_fraction * rows < cap / 4, "the cache, the batches and activations fit the cap"
    h200 = 143_771 * 2**20
    assert memory_fraction(big, h200) == pytest.approx(cap / h200)
    assert memory_fraction(busy, h200) == 1.0 and memory_fraction(big, 8 * 2**30) == 1.0
    with pytest.raises(ValueError, match="gpu_memory_gib must be positive"):
        dataclasses.replace(big, gpu_memory_gib=0)


def test_the_readmes_speed_budgets_count_the_runs_run_sh_makes():
    """Each speed step's row in the README's budget table counts the builds (the worker's primers,
    then every variant each round) and the steps of a run (warm-up, timed, drained) of run.sh's
    flags: changing the rounds or steps fails here until the budget's arithmetic says so."""
    from benchmarks import worker

    rows = dict(re.findall(r"^\| `([\w-]+)` \| \d+ \| (.+) \|$", (GPU / "README.md").read_text(), re.M))
    variants = len(_run_sh_words("SPEED_VARIANTS"))
    for step, name in (("speed", "SPEED_BUSY"), ("speed-uvm", "SPEED_UVM")):
        flags = _speed_flags(name)
        builds = len(worker._PRIMERS) + variants * int(flags["--rounds"])
        steps = int(flags["--warmup"]) + int(flags["--steps"]) + worker._TAIL
        assert f"{builds} builds" in rows[step], f"README's {step}: not {builds} builds: {rows[step]}"
        assert f"{steps} steps" in rows[step], f"README's {step}: not {steps} steps a run: {rows[step]}"


def _reduced_run(rank: int, world_size: int, name: str, variants: tuple[str, ...], store_dir: str) -> list:
    """`name`'s runs through the benchmark's worker as the speed step makes them (the primers, then
    each variant once), at a reduced size: 2,000 rows a table and 4 samples a step, the rest of the
    config as it is (tables, width, ids, MLPs, cache)."""
    from benchmarks import worker
    from benchmarks.configs import get_config
    from benchmarks.spec import RunSpec

    reduced = dataclasses.replace(get_config(name), num_embeddings=2_000, batch_size=4)
    worker.get_config = lambda _: reduced  # this rank's module; restored below
    try:
        shape = {"steps": 2, "warmup": 1, "auto_warmup": 1, "rounds": 1, "profile_steps": 0}
        spec = RunSpec(configs=(name,), variants=variants, store_dir=store_dir, **shape)
        return worker.run_rank(spec, rank)
    finally:
        worker.get_config = get_config


@pytest.mark.timeout(pytest_timeout(TIMEOUT))
@pytest.mark.parametrize("name", ["SPEED_BUSY", "SPEED_UVM"])
def test_the_speed_configs_build_and_train_at_a_reduced_size(one_rank, name, tmp_path):
    """Each speed step's config, shrunk to 2,000 rows a table and 4 samples, builds and trains every
    variant of the step on CPU through the benchmark's worker (the cached one on the `tiered` kernel,
    CUDA's UVM cache being out of reach): the model, its batches and the loops hold before a GPU
    sees them; torchrec's Prefetch, which needs CUDA, is recorded as such."""
    from benchmarks.configs import get_config
    from benchmarks.spec import CPU_UNSUPPORTED

    config = _speed_flags(name)["--configs"]
    variants = tuple(_run_sh_words("SPEED_VARIANTS"))
    records = one_rank.run(_reduced_run, config, variants, str(tmp_path), timeout=TIMEOUT)[0]
    assert [r["variant"] for r in records] == list(variants), records
    for r in records:
        if r["variant"] in CPU_UNSUPPORTED:
            assert r["status"] == "unsupported", r
            continue
        assert r["status"] == "ok" and len(r["step_times_s"]) == 2 and r["build_s"] > 0, r
        assert ("cache_hit_rate" in r) == (get_config(config).cache_fraction is not None), r


def test_the_demo_step_is_make_demo_on_one_gpu(tmp_path):
    """The demo step is `make demo DEMO_NPROC=1` but for `setup` (no network there) and BIN (the
    staged stack's python); on an image without make, the target's own commands: the same layout
    and torchrun arguments as `make -n` prints for it here."""
    out = {"DRY": "1", "OUT": str(tmp_path)}
    demo = f"{tmp_path}/results/demo"
    dry = _sh("run.sh", "demo", **out)
    made_here = f"make -o setup demo DEMO_NPROC=1 BIN=/tmp/demo-bin DEMO_OUT={demo}"
    assert dry.returncode == 0 and made_here in dry.stdout, dry
    no_make = _sh("run.sh", "demo", **out, MAKE="no-make-here")
    assert no_make.returncode == 0 and "demo: no no-make-here here" in no_make.stdout, no_make
    if not shutil.which("make"):
        pytest.skip("needs make")
    argv = ["make", "-n", "--no-print-directory", *made_here.split()[1:]]
    # as a user types it: not as a sub-make of the `make test` that may be running this test
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    made = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert made.returncode == 0, made.stderr

    def words(text: str, after: str, until: str) -> list[str]:
        return text[text.index(after) + len(after) :].split(until)[0].replace('"', "").split()

    layout, train = ("-m examples.dlrm.devices", ")"), ("OMP_NUM_THREADS=1 /tmp/demo-bin/torchrun", "\n+ ")
    for after, until in (layout, train):
        recipe = words(made.stdout, after, until)
        assert recipe and words(no_make.stdout, after, until) == recipe, (made.stdout, no_make.stdout)


def test_the_regressions_run_first(tmp_path):
    """Each `--run-first` part of the tests step names a case of tests/test_cuda.py, and those
    cases are collected before all the others."""
    dry = _sh("run.sh", "tests", DRY="1", OUT=str(tmp_path)).stdout
    parts = re.findall(r"--run-first (\S+)", dry)
    assert len(parts) >= 4, dry
    argv = [a for part in parts for a in ("--run-first", part)]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "--collect-only",
            "-p",
            "no:cacheprovider",
            *argv,
            "tests/test_cuda.py",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    ids = [ln for ln in done.stdout.splitlines() if ln.startswith("tests/test_cuda.py::")]
    assert len(ids) > 50, done.stdout[-2000:] + done.stderr[-2000:]
    first = [i for i in ids if any(part in i for part in parts)]
    assert all(any(part in i for i in first) for part in parts), f"a part names no case: {parts}"
    assert ids[: len(first)] == first, f"not first: {ids[: len(first) + 2]}"


def _budgets() -> dict:
    """run.sh's budgets: each step's (by name), START_S, CALL_S, COMMAND_S, DEVICE_S and the last
    call's steps of each sequence."""
    text = (GPU / "run.sh").read_text()
    found: dict = {k.replace("_", "-"): int(v) for k, v in re.findall(r"\bB_(\w+)=(\d+)", text)}
    for name in ("START_S", "CALL_S", "DEVICE_S"):
        found[name] = int(re.search(rf"^{name}=\$\{{{name}:-(\d+)\}}", text, re.M).group(1))
    found["COMMAND_S"] = int(re.search(r"^COMMAND_S=(\d+)", text, re.M).group(1))
    for name, sequence in (("CHECKS", "sequence"), ("SPEED", "speed-sequence")):
        found[sequence] = re.search(rf'^{name}="([^"]+)"', text, re.M).group(1).split()
    return found


def _device_seconds(b: dict, last: list[str], calls: int) -> int:
    """A sequence's device time by run.sh's rule: the start, each call's upload and wait, `receive`
    in each earlier call, and the last call's steps, each its budget but the last at most what the
    others left of the call."""
    room = b["COMMAND_S"] - b["CALL_S"]
    assert sum(b[s] for s in last[:-1]) <= room, f"{last[:-1]} overrun one command's {room} s"
    steps = sum(b[s] for s in last[:-1]) + min(b[last[-1]], room - sum(b[s] for s in last[:-1]))
    return b["START_S"] + calls * b["CALL_S"] + (calls - 1) * b["receive"] + steps


def _fits_13_minutes(seconds: int) -> None:
    assert seconds <= 780, f"{seconds} s of device time is over 13 minutes"


def test_the_readmes_budget_is_the_scripts_and_fits_13_minutes():
    """scripts/gpu/README.md's budget table gives each step's timeout in run.sh, and each sequence's
    total is what the scripts sum to: raising a timeout fails here until the README says so, and no
    total may pass 13 minutes (780 s) of device time; its twin, one second over, fails the check."""
    b = _budgets()
    rows = dict(re.findall(r"^\| (.+?) \| (\d+) \|", (GPU / "README.md").read_text(), re.M))
    steps = {k: v for k, v in b.items() if isinstance(v, int) and not k.isupper()}
    assert {k: int(rows.get(f"`{k}`", -1)) for k in steps} == steps, "README's step budgets, run.sh's differ"
    assert int(rows["start"]) == b["START_S"] and int(rows["each call"]) == b["CALL_S"], rows
    totals = {
        m.group(1): (int(m.group(2)), int(v))
        for k, v in rows.items()
        if (m := re.fullmatch(r"\*\*total of `([\w-]+)`, (\d+) calls\*\*", k))
    }
    assert set(totals) == {"sequence", "speed-sequence"}, f"README's totals: {totals}"
    for sequence, (calls, total) in totals.items():
        expected = _device_seconds(b, b[sequence], calls)
        assert total == expected, f"README's total of {sequence}, {total} s; the scripts' {expected} s"
        _fits_13_minutes(expected)
        assert b["DEVICE_S"] <= 780
        over = {**b, "START_S": b["START_S"] + 781 - expected}  # the twin: one second over
        with pytest.raises(AssertionError, match="781 s of device time is over 13 minutes"):
            _fits_13_minutes(_device_seconds(over, over[sequence], calls))


def test_csan_runs_every_class_and_torchrecs_for_comparison():
    import csan

    on_gpu = csan.cases([*CLASSES, *csan.COMPARED])
    on_cpu = csan.cases([*CLASSES, *csan.COMPARED], "cpu")
    assert {name for name, _, _ in on_cpu} == {*CLASSES, *csan.COMPARED}
    assert {name for name, _, _ in on_gpu} == {*CLASSES, *csan.COMPARED} - {*HOST_ONLY}
    assert ("TrainPipelinePT2", "nested", False) not in on_gpu, "PT2 runs the DLRM only"
    assert not any(cached for _, _, cached in on_cpu), "the cache is CUDA's"
    for name in ("PrefetchTrainPipelineSparseDist", "torchrec.PrefetchTrainPipelineSparseDist"):
        assert (name, "dlrm", True) in on_gpu, f"{name} behind the cache: ours against torchrec's"
    assert ("StagedTrainPipeline+prefetch", "dlrm", True) in on_gpu, "its prefetch stage fills the cache"


def test_memory_table_gives_both_ratios():
    import memory

    rows = [
        {"class": "TrainPipelineSparseDist", "variant": v, "peak_mb": mb, "kept_peak": 9}
        for v, mb in (("keep-alive", 90.0), ("record-stream", 100.0), ("torchrec", 120.0))
    ]
    line = memory.table(rows).splitlines()[-1]
    assert line == "| TrainPipelineSparseDist | 90 | 100 | 120 | 0.90 | 0.75 | 9 |", line


def test_memory_check_holds_where_keep_alive_is_at_most_record_stream():
    import memory

    figures = {"Base": (302.0, 236.0), "SparseDist": (245.0, 245.0), "Eval": (160.0, None)}
    rows = [
        {"class": name, "variant": v, "peak_mb": mb, "kept_peak": 1}
        for name, peaks in figures.items()
        for v, mb in zip(("keep-alive", "record-stream"), peaks, strict=True)
        if mb is not None
    ]
    lines, held = memory.check(rows)
    assert not held, lines
    assert lines == [
        "MEMORY check Base: keep-alive 302.0 MB > record_stream 236.0 MB, 66.0 MB more in flight",
        "MEMORY check SparseDist: keep-alive 245.0 MB <= record_stream 245.0 MB",
        "MEMORY check Eval: not measured with both hand-offs",
        "MEMORY check: keep-alive at most record_stream in 1 of 3 classes",
    ], lines
    assert memory.check([r for r in rows if r["class"] == "SparseDist"])[1], "equal peaks hold"


@pytest.mark.timeout(pytest_timeout(TIMEOUT))
def test_memory_script_dry_runs_on_cpu(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(GPU / "memory.py"),
            "--device",
            "cpu",
            "--config",
            "demo",
            "--steps",
            "2",
            "--classes",
            "TrainPipelineSparseDist",
            "--variants",
            "keep-alive",
            "record-stream",
            "--check",
            "--json",
            str(tmp_path / "m.json"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "MEMORY TrainPipelineSparseDist keep-alive: {" in out.stdout, out.stdout
    assert "MEMORY check: keep-alive at most record_stream in 1 of 1 classes" in out.stdout, out.stdout
    assert len(json.loads((tmp_path / "m.json").read_text())["rows"]) == 2


def _dry(rank: int, world_size: int, name: str) -> dict:
    import torch

    from tests.cuda_cases import run_case

    torch._dynamo.reset()
    return run_case(name, "dlrm", "table_wise", steps=4, device=torch.device("cpu"))


@pytest.mark.timeout(pytest_timeout(TIMEOUT))
@pytest.mark.parametrize("name", CLASSES)
def test_every_gpu_case_dry_runs_on_cpu(one_rank, name):
    """tests/test_cuda.py's cases, on CPU with RecordingStreams: the references and the classes'
    wiring hold before a GPU sees them."""
    r = one_rank.run(_dry, name, timeout=TIMEOUT)[0]
    assert r["count"] == 4 and r["outputs_equal"] and r["params_equal"], r
    assert r["kept_at_end"] == 0 and r["kept_peak"] > 0, r


def _lookup_references(rank: int, world_size: int) -> dict:
    """The lookup case's reference beside the stale loop and the plain loop: which it equals."""
    from tests import models
    from tests.cuda_cases import _reference

    data = models.batches("dlrm", 4, rank=0)
    loops = {
        "case": lambda model, opt, data: _reference("StagedTrainPipeline+lookup", model, opt, data, "eager"),
        "stale": models.stale_lookup_loop,
        "plain": models.plain_loop,
    }
    runs = {}
    for name, loop in loops.items():
        model, opt = models.build("dlrm", "table_wise")
        runs[name] = (loop(model, opt, data), model.state_dict())
    return {name: models.bitwise_equal(runs["case"], runs[name]) for name in ("stale", "plain")}


@pytest.mark.timeout(pytest_timeout(TIMEOUT))
def test_the_lookup_stages_case_is_checked_against_the_stale_loop(one_rank):
    """SparseDataDistUtil's lookup stage is semi-synchronous (batch i+1 is looked up before batch
    i's update, as torchrec documents): the case's reference is that loop, not the plain loop,
    which differs from it (so the dry run tells a stale lookup from a current one)."""
    r = one_rank.run(_lookup_references, timeout=TIMEOUT)[0]
    assert r["stale"], "the lookup case's reference is not models.stale_lookup_loop"
    assert not r["plain"], "the stale loop equals the plain loop here: the case cannot tell them apart"
