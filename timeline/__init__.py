"""Timeline of a pipelined run from its torch.profiler trace: which batch is where, and when.

``python -m timeline compare BASE_TRACE PREFETCH_TRACE -o OUT_DIR`` reads two chrome
traces (``prof.export_chrome_trace()``), finds the pipeline's ``pipeline::<stage>#<batch>`` labels
(and, on GPU, the kernels per CUDA stream), draws a few steady-state steps of both runs on one time
axis and writes tables of step time, busy time per track and hidden communication. See
docs/timeline.md for how to read them. The package imports neither torch nor torchrec, and
matplotlib only to draw.

Modules: ``trace`` reads the file, ``tracks`` builds the rows of the picture, ``stats`` measures,
``modes`` says how each traced step ran (as the trace records it), ``report`` formats the tables,
``plot`` draws, ``cli`` ties them together.
"""

from timeline.cli import CompareResult, RunAnalysis, analyse, compare_traces, main
from timeline.modes import RunModes, Segment, run_modes
from timeline.report import Comparison, Row, compare_stats
from timeline.stats import CommStats, RunStats, StepSelection, run_stats, select_steps
from timeline.trace import (
    Kernel,
    NoPipelineLabelsError,
    Span,
    Trace,
    TraceError,
    load_trace,
)
from timeline.tracks import Box, Timeline, Track, build_timeline

__all__ = [
    "Box",
    "CommStats",
    "CompareResult",
    "Comparison",
    "Kernel",
    "NoPipelineLabelsError",
    "Row",
    "RunAnalysis",
    "RunModes",
    "RunStats",
    "Segment",
    "Span",
    "StepSelection",
    "Timeline",
    "Trace",
    "TraceError",
    "Track",
    "analyse",
    "build_timeline",
    "compare_stats",
    "compare_traces",
    "load_trace",
    "main",
    "run_modes",
    "run_stats",
    "select_steps",
]
