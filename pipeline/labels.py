"""Profiler labels of the pipeline's stages.

Every stage runs under `record_function("pipeline::<stage>#<batch index>")`, e.g.
`pipeline::forward#12`. The timeline tool (`python -m timeline`) reads these names.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch.profiler import record_function

from pipeline.stages import STAGES
from pipeline.streams import Streams

__all__ = ["STAGES", "stage"]


@contextmanager
def stage(streams: Streams, name: str, index: int, stream: Any = None) -> Iterator[None]:
    """Run the enclosed work as stage `name` of batch `index` on `stream` (None: current)."""
    with record_function(f"pipeline::{name}#{index}"), streams.use(stream):
        streams.stage(name)
        yield
