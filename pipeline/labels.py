"""Profiler labels of the pipeline's stages.

A stage is one labelled unit of work of one batch (copy, input_dist::start, ..., optimizer; the
names are `pipeline.stages.STAGES`). Each runs under `record_function("pipeline::<stage>#<batch
index>")`, e.g. `pipeline::forward#12`; the timeline tool reads these names.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch.profiler import record_function

from pipeline.stages import STAGES
from pipeline.streams import Streams

__all__ = ["STAGES", "run_stage"]


@contextmanager
def run_stage(streams: Streams, name: str, index: int, stream: Any = None) -> Iterator[None]:
    """Run the enclosed work as stage `name` of batch `index` on `stream` (None: current)."""
    with record_function(f"pipeline::{name}#{index}"), streams.use(stream):
        streams.stage_started(name)
        yield
