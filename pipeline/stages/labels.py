"""Profiler labels of the pipeline's stages, paid for only while a profiler records.

A stage (copy, input_dist::start, ..., optimizer: the names `timeline.trace.STAGES` reads) runs under
`record_function("pipeline::<stage>#<batch index>")`, e.g. `pipeline::forward#12`, which the
timeline tool reads. A `record_function` costs 8-15 us of host time even with no profiler running,
so labels are made only while one records (a check of ~0.1 us). torch 2.13's `_profiler_enabled()`
says False under a profiler made with `profile_all_threads=True` (the timeline's), so the
Python-side flag that every torch.profiler sets is read too.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

from torch._C._autograd import _profiler_enabled
from torch.autograd import profiler as autograd_profiler
from torch.profiler import record_function

from pipeline.stages.streams import Streams

__all__ = ["label", "run_stage"]

_NO_LABEL = nullcontext()


def _recording() -> bool:
    return _profiler_enabled() or autograd_profiler._is_profiler_enabled


def label(text: str) -> Any:
    """A context manager labelling the enclosed work `text` while a profiler records (else a no-op)."""
    return record_function(text) if _recording() else _NO_LABEL


def run_stage(streams: Streams, name: str, index: int, stream: Any = None) -> Any:
    """A context manager running the enclosed work as stage `name` of batch `index` on `stream`
    (None: the current one). With inert streams and no profiler recording, a shared no-op: a step's
    stages then cost one call each on the hot path."""
    if streams.inert and not _recording():
        return _NO_LABEL
    return _Stage(streams, name, index, stream)


class _Stage:
    """A stage with work to do on entry: a label, a stream, a checking hook. A class, not a
    generator: entering it costs one small object, no generator frame."""

    __slots__ = ("_index", "_label", "_name", "_stream", "_streams", "_use")

    def __init__(self, streams: Streams, name: str, index: int, stream: Any = None) -> None:
        self._streams, self._name, self._index, self._stream = streams, name, index, stream
        self._label: Any = None
        self._use: Any = None

    def __enter__(self) -> None:
        if _recording():
            self._label = record_function(f"pipeline::{self._name}#{self._index}")
            self._label.__enter__()
        self._use = self._streams.use(self._stream)
        self._use.__enter__()
        self._streams.stage_started(self._name)

    def __exit__(self, *exc: Any) -> None:
        try:
            self._use.__exit__(*exc)
        finally:
            if self._label is not None:
                self._label.__exit__(*exc)
