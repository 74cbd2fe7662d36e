"""A CPU test double for the pipelines' streams, beside the library (a training job never imports
it): `RecordingStreams` runs a pipeline's hand-offs with fake named streams and events, logs every
stage, wait, hold, release and use, and `check()` proves them; `HandoffError` says what was wrong.
Pass it as a pipeline's `streams=`. Modules: `recording` (the double), `storages` (the tensors an
object holds)."""

from tests.streamcheck.recording import HandoffError, RecordingStreams

__all__ = ["HandoffError", "RecordingStreams"]
