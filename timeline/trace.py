"""Read a torch.profiler chrome trace and pick out the pipeline's stage labels and GPU kernels.

The pipelines wrap every stage in ``record_function("pipeline::<stage>#<batch>")``, for example
``pipeline::forward#12`` or ``pipeline::input_dist::start#13``. On CPU those ranges are the whole
story; on GPU the trace also holds the kernels (``"cat": "kernel"``, ``"gpu_memcpy"``, ...) with the
CUDA stream they ran on, and the CPU-side launch call that shares their ``correlation`` id, which is
how a kernel is traced back to the stage that launched it. This module only reads; it knows nothing
of tracks or statistics. Times are the trace's microseconds.
"""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STAGES = (
    "copy",
    "input_dist::start",
    "input_dist::splits",
    "input_dist::wait",
    "prefetch",
    "lookup",
    "forward",
    "backward",
    "optimizer",
)
"""The stage names the pipeline labels, in data-path order. Kept here, so that the tool needs neither
torch nor torchrec; a test checks it against the stages the pipeline's source labels."""

__all__ = [
    "STAGES",
    "STEPS_KEY",
    "Kernel",
    "NoPipelineLabelsError",
    "Span",
    "Trace",
    "TraceError",
    "load_trace",
    "parse_label",
]


STEPS_KEY = "pipeline_steps"
"""The trace's top-level key with the pipeline's account of each recorded step (`timeline.modes`)."""

LABEL_RE = re.compile(r"^pipeline::(?P<stage>.+)#(?P<batch>\d+)$")
# Kernel-like activities on the GPU timeline; each carries args.stream and args.correlation.
_GPU_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
# CPU-side calls that launch GPU work; args.correlation links them to the kernel.
_LAUNCH_CATS = frozenset({"cuda_runtime", "cuda_driver", "hip_runtime", "hip_driver"})
_EXPECTED = (
    "expected a torch.profiler chrome trace (what prof.export_chrome_trace() writes): "
    "a JSON object with a 'traceEvents' list, optionally gzip-compressed (.json.gz)"
)


class TraceError(ValueError):
    """The file is not a chrome trace the analyser can use."""


class NoPipelineLabelsError(TraceError):
    """The trace is valid but holds no ``pipeline::<stage>#<batch>`` labels."""


@dataclass(frozen=True, slots=True)
class Span:
    """One labelled CPU range: a stage of one batch."""

    stage: str
    """Stage name, e.g. ``forward`` or ``input_dist::wait``."""
    batch: int
    """Batch index from the label (counted from 0 per pipeline object)."""
    start: float
    """Start in trace microseconds."""
    end: float
    """End in trace microseconds."""
    thread: tuple[Any, Any]
    """(pid, tid) of the thread that recorded it."""


@dataclass(frozen=True, slots=True)
class Kernel:
    """One GPU activity (kernel, memcpy or memset) on a CUDA stream."""

    name: str
    start: float
    end: float
    stream: int
    correlation: int | None
    """Id shared with the CPU launch call, None when the trace has none."""


@dataclass(frozen=True, slots=True)
class Trace:
    """What the analyser needs from one trace file."""

    path: str
    spans: tuple[Span, ...]
    """Pipeline stage labels, sorted by start."""
    kernels: tuple[Kernel, ...]
    """GPU activities, sorted by start; empty for a CPU-only trace."""
    launches: dict[int, tuple[float, tuple[Any, Any]]]
    """correlation id -> (start, (pid, tid)) of the CPU call that launched the kernel."""
    steps: Any = None
    """The trace's top-level `STEPS_KEY` (how the pipeline ran each recorded step:
    `timeline.modes`), None where it has none; as read, not checked."""


def parse_label(name: str) -> tuple[str, int] | None:
    """Split ``pipeline::<stage>#<batch>`` into (stage, batch); None for any other name.

    Detail labels nested in a stage, like ``pipeline::prefetch::<module>#3``, give None too: their
    time is already inside the stage's own label.
    """
    match = LABEL_RE.match(name)
    if match is None:
        return None
    stage = match["stage"]
    if stage not in STAGES and any(stage.startswith(f"{known}::") for known in STAGES):
        return None
    return stage, int(match["batch"])


def _read_json(path: Path) -> Any:
    raw = path.read_bytes()
    try:
        if raw[:2] == b"\x1f\x8b":  # gzip magic, whatever the file is called
            raw = gzip.decompress(raw)
        return json.loads(raw)
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TraceError(f"{path}: not valid JSON ({err}); {_EXPECTED}") from None


def _events(path: Path) -> tuple[list[Any], Any]:
    """The trace's events and its ``pipeline_steps`` (None if absent)."""
    data = _read_json(path)
    events = data.get("traceEvents") if isinstance(data, dict) else None
    if not isinstance(events, list):
        raise TraceError(f"{path}: no 'traceEvents' list; {_EXPECTED}")
    return events, data.get(STEPS_KEY)


def _interval(event: dict[str, Any]) -> tuple[float, float]:
    start = float(event.get("ts", 0.0))
    return start, start + float(event.get("dur", 0.0))


def _add_event(
    event: Any,
    spans: list[Span],
    kernels: list[Kernel],
    launches: dict[int, tuple[float, tuple[Any, Any]]],
) -> None:
    if not isinstance(event, dict) or event.get("ph") != "X":
        return
    cat = event.get("cat", "")
    args = event.get("args") or {}
    if cat in _GPU_CATS and "stream" in args:
        start, end = _interval(event)
        corr = args.get("correlation")
        kernels.append(Kernel(str(event.get("name", "")), start, end, int(args["stream"]), corr))
    elif cat in _LAUNCH_CATS and "correlation" in args:
        launches[int(args["correlation"])] = (float(event["ts"]), (event.get("pid"), event.get("tid")))
    elif cat != "gpu_user_annotation":  # the GPU copy of a label; the CPU one is the reference
        label = parse_label(str(event.get("name", "")))
        if label is not None:
            start, end = _interval(event)
            spans.append(Span(label[0], label[1], start, end, (event.get("pid"), event.get("tid"))))


def load_trace(path: str | Path) -> Trace:
    """Load a chrome trace (.json or .json.gz) and extract stage labels, kernels and launches.

    Args:
        path: File written by ``prof.export_chrome_trace()``.

    Returns:
        The labels, kernels and launch calls, each sorted by time.

    Raises:
        OSError: The file cannot be read.
        TraceError: The file is not JSON or has no ``traceEvents`` list.
        NoPipelineLabelsError: The trace has no ``pipeline::forward#<batch>`` labels.
    """
    path = Path(path)
    spans: list[Span] = []
    kernels: list[Kernel] = []
    launches: dict[int, tuple[float, tuple[Any, Any]]] = {}
    events, steps = _events(path)
    for event in events:
        _add_event(event, spans, kernels, launches)
    if not any(span.stage == "forward" for span in spans):
        found = sorted({span.stage for span in spans})
        raise NoPipelineLabelsError(
            f"{path}: no pipeline stage labels 'pipeline::forward#<batch>' "
            f"(found stages: {found or 'none'}); expected a trace recorded around a pipeline's "
            "progress(), with record_function ranges like 'pipeline::forward#12'"
        )
    spans.sort(key=lambda s: (s.start, -s.end))
    kernels.sort(key=lambda k: (k.start, k.end))
    return Trace(str(path), tuple(spans), tuple(kernels), launches, steps)
