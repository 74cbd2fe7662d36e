"""The names of the pipeline's stages, as they appear in profiler labels `pipeline::<stage>#<batch>`.

The timeline tool keeps its own copy (`timeline.trace.STAGES`), so that it needs no torch; a test
checks that the two agree.
"""

__all__ = ["STAGES"]

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
