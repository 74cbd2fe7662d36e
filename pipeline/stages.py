"""The names of the pipeline's stages, as they appear in profiler labels `pipeline::<stage>#<batch>`.

Kept free of imports so the timeline tool can read it without loading torch.
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
