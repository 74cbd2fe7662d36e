"""Tests of the timeline tool (timeline/, `python -m timeline`): numbers computed by hand, picture, errors.

The fixture tests/fixtures/timeline_small.json is a SparseDist-style CPU trace of 7 batches with
round microsecond times. With w = [300, 250, 50, 150, 100, 100, 100] (the input_dist::wait of each
batch) and P the start of progress call i (P0 = 300, then P += 900 + w[i]), call i labels:

    copy#i+2            [P,       P+100]        (while i+2 < 7)
    input_dist::start#i+1 [P+100, P+200]        (while i+1 < 7)
    forward#i           [P+200,   P+500+w]
      input_dist::wait#i  [P+250, P+250+w]      (inside forward: exposed)
    backward#i          [P+500+w, P+800+w]
    optimizer#i         [P+800+w, P+900+w]

plus copy#0, copy#1 and input_dist::start#0 ahead of call 0. So forward#i starts at F = P+200, step i
takes 900 + w[i] (1200, 1150, 950, 1050, 1000, 1000), and the collective of batch i lives from the
end of start#i (P[i-1]+200) to the end of wait#i (P[i]+250+w[i]): 950 + w[i-1] + w[i].
Steps 4 and 5 see no copy (the data is drained), so they are not steady state.
"""

from __future__ import annotations

import ast
import gzip
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from timeline import (
    NoPipelineLabelsError,
    TraceError,
    analyse,
    compare_traces,
    load_trace,
    main,
)
from timeline.trace import parse_label

FIXTURE = Path(__file__).parent / "fixtures" / "timeline_small.json"
ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _without_input_dist(tmp_path: Path) -> Path:
    """The fixture as the base pipeline records it: no input_dist labels."""
    data = json.loads(FIXTURE.read_text())
    data["traceEvents"] = [e for e in data["traceEvents"] if "input_dist" not in e["name"]]
    path = tmp_path / "base.json"
    path.write_text(json.dumps(data))
    return path


def test_fixture_numbers_match_hand_computation() -> None:
    run = analyse(FIXTURE, "sparse-dist", warmup=1)
    assert run.selection.steps == (0, 1, 2, 3, 4, 5)
    assert run.selection.steady == (1, 2, 3)  # step 0 is warm-up, steps 4-5 the drain
    stats = run.stats
    assert stats.device == "cpu"
    assert stats.step_times_us == {0: 1200, 1: 1150, 2: 950, 3: 1050, 4: 1000, 5: 1000}
    assert stats.step_us == 1050  # median(1150, 950, 1050)
    assert stats.busy_us == {
        "copy": 100,
        "input_dist::start": 100,
        "input_dist::wait": 150,  # mean(250, 50, 150)
        "forward": 450,  # mean(300 + w)
        "backward": 300,
        "optimizer": 100,
    }
    assert stats.outside_labels_us == 0  # the labels tile every steady step
    comm = stats.comm
    assert comm is not None and comm.batches == 3
    assert comm.total_us == 1300  # mean(950+300+250, 950+250+50, 950+50+150)
    assert comm.exposed_us == 150  # every wait lies inside its forward
    assert comm.wait_us == 150
    assert comm.hidden_us == 1150
    assert comm.overlap_ratio == pytest.approx(1150 / 1300)


def test_default_warmup_skips_two_steps() -> None:
    stats = analyse(FIXTURE, "sparse-dist").stats
    assert stats.steady_steps == (2, 3)
    assert stats.step_us == 1000  # median(950, 1050)
    assert stats.busy_us["forward"] == 400
    assert stats.comm is not None
    assert (stats.comm.total_us, stats.comm.exposed_us) == (1200, 100)
    assert stats.comm.overlap_ratio == pytest.approx(11 / 12)


def test_drawn_steps_are_the_most_typical_ones() -> None:
    # Steady steps 1-3 take 1150, 950, 1050 us (median 1050): step 3 alone is the typical one,
    # and of the pairs, 1-2 (2100 us) beats 2-3 (2000 us) against 2 x 1050.
    assert analyse(FIXTURE, "x", warmup=1, steps=1).selection.shown == (3,)
    assert analyse(FIXTURE, "x", warmup=1, steps=2).selection.shown == (1, 2)
    assert analyse(FIXTURE, "x", warmup=1, steps=9).selection.shown == (1, 2, 3)


def test_tracks_and_labels_are_read_from_the_right_events() -> None:
    trace = load_trace(FIXTURE)
    # The gpu_user_annotation copy of forward#2 (earlier, 10 us long) and the detail label
    # pipeline::forward::dense#2 are not stage labels.
    (forward2,) = [s for s in trace.spans if (s.stage, s.batch) == ("forward", 2)]
    assert (forward2.start, forward2.end) == (1_002_850, 1_003_200)
    assert {s.stage for s in trace.spans} == {
        "copy",
        "input_dist::start",
        "input_dist::wait",
        "forward",
        "backward",
        "optimizer",
    }
    tracks = [track.name for track in analyse(FIXTURE, "x").timeline.tracks]
    assert tracks[:3] == ["copy", "input_dist::start", "input_dist (in flight)"]
    assert parse_label("pipeline::input_dist::start#13") == ("input_dist::start", 13)
    assert parse_label("pipeline::prefetch::ebc#3") is None
    assert parse_label("ProfilerStep#3") is None


def test_base_run_has_no_communication_numbers(tmp_path: Path) -> None:
    stats = analyse(_without_input_dist(tmp_path), "base", warmup=1).stats
    assert stats.comm is None
    assert stats.step_us == 1050
    assert "input_dist::wait" not in stats.busy_us


def test_compare_writes_png_markdown_and_json(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = compare_traces(_without_input_dist(tmp_path), FIXTURE, out, warmup=1, steps=2)
    png = out / "timeline.png"
    assert result.png == png and png.stat().st_size > 10_000
    assert png.read_bytes()[:8] == PNG_MAGIC
    record = json.loads((out / "timeline.json").read_text())
    assert [r["label"] for r in record["runs"]] == ["base", "prefetch"]
    assert record["runs"][1]["shown_steps"] == [1, 2]
    rows = {row["metric"]: row for row in record["comparison"]["rows"]}
    assert rows["step time (median)"]["diff"] == 0
    assert rows["communication exposed (in forward)"]["base"] is None
    assert rows["communication exposed (in forward)"]["prefetch"] == 150
    markdown = (out / "timeline.md").read_text()
    assert "| step time (median) | 1.050 ms |" in markdown
    assert "| overlap ratio (hidden/total) | n/a | 88.5% | n/a | n/a |" in markdown


def test_gzipped_trace_gives_the_same_numbers(tmp_path: Path) -> None:
    path = tmp_path / "trace.json.gz"
    path.write_bytes(gzip.compress(FIXTURE.read_bytes()))
    assert analyse(path, "x").stats == analyse(FIXTURE, "x").stats


@pytest.mark.parametrize(
    ("content", "error", "expected"),
    [
        ("this is not json {", TraceError, "not valid JSON"),
        ('{"schemaVersion": 1}', TraceError, "'traceEvents' list"),
        ("[1, 2, 3]", TraceError, "'traceEvents' list"),
        (
            '{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1, "dur": 2}]}',
            NoPipelineLabelsError,
            "pipeline::forward#<batch>",
        ),
    ],
)
def test_unusable_files_raise_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, error: type, expected: str
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    with pytest.raises(error, match=expected):
        load_trace(bad)
    assert main(["compare", str(FIXTURE), str(bad), "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and expected in err and err.count("\n") == 1


def test_too_few_steps_is_a_trace_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="lower --warmup"):
        analyse(FIXTURE, "x", warmup=5)


def test_cli_exits_nonzero_with_one_line_and_no_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "notes.txt"
    bad.write_text("random text, not a trace\n")
    proc = subprocess.run(
        [sys.executable, "-m", "timeline", "compare", str(bad), str(FIXTURE), "-o", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ")
    assert "Traceback" not in proc.stderr and "expected a torch.profiler chrome trace" in proc.stderr


def test_timeline_package_imports_neither_torch_nor_torchrec() -> None:
    """The analyser stays fast: none of its modules may pull torch or torchrec in."""
    code = (
        "import sys; import timeline, timeline.plot;"
        "print(sorted(m for m in ('torch', 'torchrec') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
    assert not (ROOT / "pipeline" / "timeline").exists(), "the tool lives in timeline/, not in the library"
    for source in (ROOT / "timeline").glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                assert not any(n and n.split(".")[0] in {"torch", "torchrec"} for n in names)


def _gpu_trace(path: Path) -> Path:
    """Five progress calls, 1000 us apart, with one kernel per stage on streams 20/24/7.

    Per call at P: copy [P, P+100] launches a memcpy on stream 20 at [P+20, P+120]; input_dist::start
    [P+100, P+200] an all-to-all on stream 24 at [P+150, P+400]; forward [P+200, P+600] (with
    input_dist::wait [P+220, P+260]) a kernel on stream 7 at [P+300, P+500]; backward [P+600, P+900]
    is launched by autograd's thread (tid 2) onto stream 7 at [P+700, P+850]; optimizer
    [P+900, P+950] at [P+920, P+990]; and an unlabelled launch at P+960 runs at [P+995, P+999].
    """
    events: list[dict] = []

    def event(cat: str, name: str, start: int, end: int, pid: int, tid: int, **args: int) -> None:
        events.append(
            {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": start, "dur": end - start}
        )
        if args:
            events[-1]["args"] = args

    def cpu(name: str, start: int, end: int) -> None:
        event("user_annotation", name, start, end, pid=1, tid=1)

    def kernel(corr: int, launch: int, tid: int, stream: int, start: int, end: int) -> None:
        event("cuda_runtime", "cudaLaunchKernel", launch, launch + 5, pid=1, tid=tid, correlation=corr)
        event("kernel", "k", start, end, pid=0, tid=stream, stream=stream, correlation=corr)

    for i in range(5):
        p, c = 1000 * i, 10 * i
        cpu(f"pipeline::copy#{i + 2}", p, p + 100)
        kernel(c + 1, p + 10, 1, 20, p + 20, p + 120)
        cpu(f"pipeline::input_dist::start#{i + 1}", p + 100, p + 200)
        kernel(c + 2, p + 110, 1, 24, p + 150, p + 400)
        cpu(f"pipeline::forward#{i}", p + 200, p + 600)
        cpu(f"pipeline::input_dist::wait#{i}", p + 220, p + 260)
        kernel(c + 3, p + 270, 1, 7, p + 300, p + 500)
        cpu(f"pipeline::backward#{i}", p + 600, p + 900)
        kernel(c + 4, p + 650, 2, 7, p + 700, p + 850)
        cpu(f"pipeline::optimizer#{i}", p + 900, p + 950)
        kernel(c + 5, p + 910, 1, 7, p + 920, p + 990)
        kernel(c + 6, p + 960, 1, 7, p + 995, p + 999)
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_gpu_trace_is_drawn_per_stream(tmp_path: Path) -> None:
    run = analyse(_gpu_trace(tmp_path / "gpu.json"), "gpu", warmup=1)
    assert run.timeline.device == "cuda"
    assert [track.name for track in run.timeline.tracks] == ["memcpy", "data_dist", "default"]
    default = {(b.stage, b.batch) for b in run.timeline.tracks[2].boxes}
    assert ("backward", 3) in default  # launched from autograd's thread, still attributed
    assert ("unlabelled", None) in default
    stats = run.stats
    assert stats.steady_steps == (1, 2, 3)
    assert stats.step_us == 1000  # first forward kernel to the next: P+300 each call
    # Window [P+300, P+1300): default = 200 + 150 + 70 + 4; memcpy = next call's copy; data_dist =
    # this call's all-to-all from P+300 (100) + the next one's up to P+1300 (150).
    assert stats.busy_us == {"memcpy": 100, "data_dist": 250, "default": 424}
    assert stats.outside_labels_us == 50  # CPU gap between optimizer end (P+950) and the next copy
    assert stats.comm is not None  # from the CPU labels: end of start (P-800) to end of wait (P+260)
    assert (stats.comm.total_us, stats.comm.exposed_us) == (1060, 40)
    out = tmp_path / "out"
    compare_traces(tmp_path / "gpu.json", tmp_path / "gpu.json", out, labels=("a", "b"), warmup=1)
    assert (out / "timeline.png").read_bytes()[:8] == PNG_MAGIC


def test_real_profiler_trace_is_understood(tmp_path: Path) -> None:
    """A Prefetch-style loop recorded by torch.profiler: the wait is inside prefetch, not forward."""
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile, record_function

    def label(stage: str, batch: int) -> record_function:
        return record_function(f"pipeline::{stage}#{batch}")

    n = 6
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for batch, stage in ((0, "copy"), (1, "copy"), (0, "input_dist::start")):
            with label(stage, batch):
                torch.ones(8)
        for i in range(n):
            if i + 2 < n:
                with label("copy", i + 2):
                    torch.ones(64).clone()
            if i + 1 < n:
                with label("input_dist::start", i + 1):
                    torch.ones(8)
            with label("prefetch", i), label("input_dist::wait", i):
                time.sleep(0.001)
            with label("forward", i):
                time.sleep(0.002)
            with label("backward", i):
                torch.ones(8).sum()
            with label("optimizer", i):
                torch.ones(8).add_(1)
    path = tmp_path / "rank0.json"
    prof.export_chrome_trace(str(path))

    run = analyse(path, "prefetch", warmup=1)
    assert run.selection.steps == (0, 1, 2, 3, 4)
    assert run.selection.steady == (1, 2)  # steps 3-4 copy nothing: the drain
    stats = run.stats
    assert stats.step_us >= 3000  # two sleeps per step
    assert stats.busy_us["forward"] >= 2000
    assert stats.comm is not None
    assert stats.comm.exposed_us == 0 and stats.comm.overlap_ratio == 1.0
    assert stats.comm.wait_us >= 1000


def test_the_tool_knows_every_stage_the_pipeline_labels():
    from timeline.trace import STAGES as tool_stages

    labelled = set()
    for source in (ROOT / "pipeline").rglob("*.py"):
        text = source.read_text()
        labelled |= set(re.findall(r'run_stage\([^,]+, "([\w:]+)"', text))  # run_stage(streams, "copy", ...)
        labelled |= set(re.findall(r'"pipeline::([\w:]+)#\{', text))  # f"pipeline::input_dist::wait#{i}"
    assert labelled == set(tool_stages), "timeline.trace.STAGES is out of date with the pipeline's stages"


def _with_steps(tmp_path: Path, steps: list) -> Path:
    """The fixture (forward#0-6) with the pipeline's account of each recorded step."""
    data = json.loads(FIXTURE.read_text())
    data["pipeline_steps"] = steps
    path = tmp_path / "prefetch.json"
    path.write_text(json.dumps(data))
    return path


_WATCHING = {
    "pipeline": "PrefetchTrainPipelineSparseDist",
    "prefetch": "inline",
    "prefetch_by": "watch: watching",
    "input_dist_schedule": "early",
    "schedule_by": "pinned",
}
_TRYING = {**_WATCHING, "prefetch": "ahead", "prefetch_by": "watch: trying"}


def test_the_tables_and_the_picture_say_how_each_traced_step_ran(tmp_path: Path) -> None:
    """The trace's account of its 7 steps (3 inline, then 4 ahead) is matched to forward#0-6 in
    order and said per run in the run's table, the comparison's heading, the JSON and the picture's
    title; a trace without one says so and claims no mode."""
    out = tmp_path / "out"
    prefetch = _with_steps(tmp_path, [_WATCHING] * 3 + [_TRYING] * 4)
    result = compare_traces(_without_input_dist(tmp_path), prefetch, out, warmup=1, steps=2)
    markdown = (out / "timeline.md").read_text()
    assert "- PrefetchTrainPipelineSparseDist, traced forward#0-6 (7 steps)" in markdown
    assert "- forward#0-2: prefetch inline (watch: watching); input_dist early (pinned)" in markdown
    assert "- forward#3-6: prefetch ahead (watch: trying); input_dist early (pinned)" in markdown
    assert "- base: pipeline ?: mode not recorded" in markdown
    assert "- mode: not in the trace (no top-level 'pipeline_steps' list)" in markdown
    assert "#3-6: prefetch ahead (watch: trying)" in _title_of(result.runs[1])
    record = json.loads((out / "timeline.json").read_text())
    segments = record["runs"][1]["modes"]["segments"]
    assert [(s["first"], s["last"], s["mode"]["prefetch"]) for s in segments] == [
        (0, 2, "inline"),
        (3, 6, "ahead"),
    ]
    assert record["runs"][0]["modes"]["segments"] == []


def test_an_account_that_does_not_match_the_steps_claims_no_mode(tmp_path: Path) -> None:
    """The twin: 6 steps described for 7 forwards (a step lost or one too many) cannot be matched
    to them in order: the table says so, and names no mode."""
    run = analyse(_with_steps(tmp_path, [_TRYING] * 6), "prefetch")
    lines = run.modes.lines()
    assert run.modes.segments == ()
    assert "- mode: 6 steps described for 7 forwards in the trace: not matched" in lines
    assert not any("ahead" in line for line in lines)


def _title_of(run) -> str:
    """The picture's title of `run`'s panel."""
    from timeline.cli import _title

    return _title(run)


def test_the_dlrm_profiler_records_each_recorded_step_s_mode_in_the_trace(tmp_path: Path) -> None:
    """examples/dlrm's profiler writes `describe()` of exactly the recorded steps (not the profiler's
    warm-up step, not the steps after), which the tool matches to the trace's forwards."""
    torch = pytest.importorskip("torch")
    from torch.profiler import record_function

    from examples.dlrm.profiling import step_profiler

    mode = {"pipeline": "P", "prefetch": "inline", "prefetch_by": "pinned"}
    with step_profiler(
        str(tmp_path), rank=0, device=torch.device("cpu"), skip=2, active=4, describe=lambda: dict(mode)
    ) as step:
        for i in range(9):
            mode["prefetch"] = "ahead" if i >= 5 else "inline"
            with record_function(f"pipeline::copy#{i + 1}"):
                torch.ones(8)
            with record_function(f"pipeline::forward#{i}"):
                torch.ones(8).sum()
            step()
    trace = load_trace(tmp_path / "rank0.json")
    run = analyse(tmp_path / "rank0.json", "p", warmup=0, steps=1)
    assert [s["prefetch"] for s in trace.steps] == ["inline", "inline", "ahead", "ahead"]
    assert [(s.first, s.last, s.mode["prefetch"]) for s in run.modes.segments] == [
        (3, 4, "inline"),
        (5, 6, "ahead"),
    ]


def test_running_mode_is_read_from_the_pipeline_object() -> None:
    """What the profiler records is what the pipeline object says at that step: its class, the
    prefetch stage's mode and who chose it, the schedule and who chose it."""
    pytest.importorskip("torch")
    from types import SimpleNamespace

    from examples.dlrm.runners import running_mode
    from pipeline.stages.watch import WatchPhase

    watch = SimpleNamespace(phase=WatchPhase.TRYING)
    pipe = SimpleNamespace(
        prefetch_mode="prefetch",
        prefetch_ahead=True,
        prefetch_watch=None,
        input_dist_schedule="late",
        tuner=watch,
    )
    assert running_mode(pipe) == {
        "pipeline": "SimpleNamespace",
        "prefetch": "ahead",
        "prefetch_by": "pinned",
        "input_dist_schedule": "late",
        "schedule_by": "watch: trying",
    }
    pipe.prefetch_ahead, pipe.prefetch_watch, pipe.tuner = False, watch, None
    assert running_mode(pipe) == {
        "pipeline": "SimpleNamespace",
        "prefetch": "inline",
        "prefetch_by": "watch: trying",
        "input_dist_schedule": "late",
        "schedule_by": "pinned",
    }
    assert running_mode(SimpleNamespace()) == {"pipeline": "SimpleNamespace"}  # the base pipeline
