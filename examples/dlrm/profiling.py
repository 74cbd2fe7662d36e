"""Record a few training steps after warm-up with torch.profiler, one chrome trace per rank.

The trace (`DIR/rank{r}.json`) opens in Perfetto (ui.perfetto.dev) or chrome://tracing; the
pipelines' `pipeline::...` record_function labels show which stage ran when. How the pipeline ran
each recorded step (`describe`: e.g. prefetch ahead or inline, and the input_dist schedule, read
from the pipeline object) is in the trace too, under the top-level key `pipeline_steps`: a list with
one entry per recorded step, in order (`python -m timeline` reads it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerAction, ProfilerActivity, profile, schedule

from pipeline.stages.streams import profiling_all_threads

__all__ = ["STEPS_KEY", "step_profiler"]

STEPS_KEY = "pipeline_steps"
"""The trace's top-level key holding `describe()` of every recorded step."""


@contextmanager
def step_profiler(
    trace_dir: str | None,
    *,
    rank: int,
    device: torch.device,
    skip: int,
    active: int,
    describe: Callable[[], dict[str, Any]] | None = None,
) -> Iterator[Callable[[], None]]:
    """Yield a `step()` to call after every training step; profiles steps skip+2 .. skip+1+active,
    and writes `describe()` of each of them into the trace (`STEPS_KEY`).

    Every thread is recorded, the prefetch pipeline's worker included (`profiling_all_threads`), so
    the trace shows the prefetch stage where it really runs. One step after `skip` is the
    profiler's own warm-up, whose events are dropped. With
    `trace_dir` None this records nothing. A run too short to reach the recorded steps writes no
    trace; the caller can check for the file.
    """
    if trace_dir is None:
        yield lambda: None
        return
    path = Path(trace_dir) / f"rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    # Kineto prints a `USDT: ... profiler_start` line (and more) at every start and stop; its levels
    # end at USDT = 5, so 6 silences it. This hides kineto's own error lines too: set
    # KINETO_LOG_LEVEL yourself to see them.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    prof = profile(
        activities=activities,
        schedule=schedule(skip_first=skip, wait=0, warmup=1, active=active, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(str(path)),
        experimental_config=_ExperimentalConfig(profile_all_threads=True),
    )
    recorded: list[dict[str, Any]] = []

    def step() -> None:
        action = prof.current_action  # what the profiler did during the step just run
        if describe is not None and action in (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE):
            recorded.append(describe())
            if action is ProfilerAction.RECORD_AND_SAVE:  # the last one: `prof.step()` writes the trace
                prof.add_metadata_json(STEPS_KEY, json.dumps(recorded))
        prof.step()

    with prof, profiling_all_threads():
        yield step
