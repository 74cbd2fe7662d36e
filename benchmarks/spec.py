"""What one benchmark invocation runs: `RunSpec`, the variant names, and the order of a round.

Kept free of torch imports: the launcher and the report read it without loading torch.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from benchmarks.configs import get_config

__all__ = [
    "ALL_VARIANTS",
    "AUTO_VARIANTS",
    "BOUND_VARIANTS",
    "CAPTURING_VARIANTS",
    "CPU_UNSUPPORTED",
    "FAMILY_VARIANTS",
    "FORCED_VARIANTS",
    "IO_VARIANTS",
    "MEMORY_FLAGS",
    "MEMORY_VARIANTS",
    "NOVOTE_VARIANTS",
    "OURS_TO_TORCHREC",
    "PREFETCH_FORCED_VARIANTS",
    "SCHEDULE_NAMES",
    "VARIANTS",
    "RunSpec",
    "round_order",
]

VARIANTS = (
    "plain",
    "ours-base",
    "ours-sparse-dist",
    "ours-prefetch",
    "torchrec-base",
    "torchrec-sparse-dist",
    "torchrec-prefetch",
)
"""The training loops compared by default; see `benchmarks.variants`."""
SCHEDULE_NAMES = ("early", "late", "early-shared", "late-own")
"""`pipeline.stages.schedule.SCHEDULES` (repeated here to keep this module free of torch)."""
FORCED_VARIANTS = tuple(f"ours-sparse-dist@{name}" for name in SCHEDULE_NAMES)
"""Our SparseDist with `input_dist_schedule` forced to one schedule."""
PREFETCH_FORCED_VARIANTS = tuple(f"ours-prefetch@{name}" for name in SCHEDULE_NAMES)
"""Our Prefetch pipeline with `input_dist_schedule` forced to one schedule."""
BOUND_VARIANTS = ("compute-alone", "comm-alone")
"""Not training loops: the two halves of the bound (`benchmarks.bound`)."""
IO_VARIANTS = ("io-alone",)
"""Not a training loop: tables on disk, the prefetch of the same batches with no forward or backward
(`benchmarks.disk_bound`); with `compute-alone` (every row cached there) the bound of Prefetch."""
CAPTURING_VARIANTS = (*BOUND_VARIANTS, *IO_VARIANTS)
"""Variants that replay what `benchmarks.bound.capture` recorded of each batch."""
NOVOTE_VARIANTS = ("ours-base+novote", "ours-sparse-dist@late+novote")
"""Our pipelines with the per-batch vote and checks off (`agreement=False, check_keys=False, ...`):
what `benchmarks.agreement` compares with `ours-base` and `ours-sparse-dist@late` to price them."""
MEMORY_FLAGS = {
    "+inplace-copy": "enable_inplace_copy_batch",
    "+free-features": "free_features_storage_early",
    "+clear-inputs": "clear_data_dist_inputs",
    "+copy-after-forward": "enqueue_batch_after_forward",
}
"""Variant suffixes that turn one of torchrec's memory (and ordering) flags on."""
MEMORY_VARIANTS = tuple(f"ours-sparse-dist@late{suffix}" for suffix in MEMORY_FLAGS)
"""Our SparseDist (schedule forced to "late") with each flag on: what `benchmarks.memory_flags`
compares with `ours-sparse-dist@late` to measure what each flag frees."""
FAMILY_VARIANTS = (
    "ours-fused-sparse-dist",
    "torchrec-fused-sparse-dist",
    "ours-semi-sync",
    "torchrec-semi-sync",
    "ours-eval",
    "torchrec-eval",
    "ours-staged",
)
"""The rest of torchrec's family, ours against torchrec's same class (issue 14): SemiSync with
`start_batch=0`; the eval pipelines time forward only (the model in eval mode); `ours-staged` is a
StagedTrainPipeline (copy, input_dist) around the plain loop's forward/backward/step."""
ALL_VARIANTS = (
    *VARIANTS,
    *FORCED_VARIANTS,
    *PREFETCH_FORCED_VARIANTS,
    *BOUND_VARIANTS,
    *IO_VARIANTS,
    *NOVOTE_VARIANTS,
    *MEMORY_VARIANTS,
    *FAMILY_VARIANTS,
)
AUTO_VARIANTS = ("ours-sparse-dist", "ours-prefetch")
"""Variants that tune `input_dist_schedule="auto"` during their first steps."""
CPU_UNSUPPORTED = ("torchrec-prefetch", "torchrec-fused-sparse-dist", "torchrec-semi-sync")
"""torchrec 1.8's pipelines that fail on CPU at their first steps; recorded as unsupported there."""
OURS_TO_TORCHREC = {
    "ours-base": "torchrec-base",
    "ours-sparse-dist": "torchrec-sparse-dist",
    "ours-prefetch": "torchrec-prefetch",
    "ours-fused-sparse-dist": "torchrec-fused-sparse-dist",
    "ours-semi-sync": "torchrec-semi-sync",
    "ours-eval": "torchrec-eval",
}


@dataclass(kw_only=True, slots=True)
class RunSpec:
    """What one benchmark invocation runs; the same on every rank."""

    configs: tuple[str, ...]
    """Names from `benchmarks.configs.CONFIGS`."""
    variants: tuple[str, ...] = VARIANTS
    """Names from `VARIANTS`."""
    steps: int = 30
    """Timed steps per run."""
    warmup: int = 20
    """Untimed steps before the timed ones (first-batch rewrite, allocator warm-up)."""
    auto_warmup: int = 75
    """Untimed steps before the timed ones for `AUTO_VARIANTS`: enough to cover the tuner's first
    decision (2 warm-up steps + 4 visits + 3 rounds x 4 schedules x 4 steps = 54 at most with
    `Tuner()`'s defaults)."""
    rounds: int = 4
    """Repetitions of every variant; the order of variants is rotated between rounds."""
    profile_steps: int = 5
    """Steps of the separate profiled segment (input_dist wait inside forward); 0 skips it."""
    seed: int = 0
    """Seeds the models and the batches."""
    device: str = "cpu"
    """`cpu` (gloo) or `cuda` (nccl, one GPU per rank)."""
    trace_dir: str | None = None
    """Write each profiled segment's chrome trace here (`<config>_<variant>_r<round>_rank<r>.json`,
    readable by `python -m timeline`); None writes none."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.rounds < 1 or min(self.warmup, self.auto_warmup, self.profile_steps) < 0:
            raise ValueError("steps and rounds must be positive, warmup and profile_steps not negative")
        if not self.configs:
            raise ValueError("no configs to run")
        for name in self.configs:
            get_config(name)
        unknown = set(self.variants) - set(ALL_VARIANTS)
        if unknown or not self.variants:
            raise ValueError(f"unknown variants {sorted(unknown)}; choose from {', '.join(ALL_VARIANTS)}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")

    def warmup_of(self, variant: str) -> int:
        """Untimed steps before `variant`'s timed ones."""
        return self.auto_warmup if variant in AUTO_VARIANTS else self.warmup

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
        raw = json.loads(text)
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})


def round_order(variants: tuple[str, ...], round_index: int) -> list[str]:
    """`variants` rotated so that each round starts with a different one, spread evenly."""
    stride = max(1, len(variants) // 3)
    shift = (round_index * stride) % len(variants)
    return [*variants[shift:], *variants[:shift]]
