"""What one benchmark launch runs on every rank (`RunSpec`), the variant names, and a round's order.

A variant is a training loop: `NAME[@SCHEDULE][+FLAG...]`. NAME is `plain` (copy, zero_grad,
forward, backward, step), one of our pipelines (`ours-...`), torchrec's same class
(`torchrec-...`), or a half of a bound (`compute-alone`, `comm-alone`, `io-alone`: `benchmarks.bound`).
`@SCHEDULE` forces our `InputDistOptions.schedule`; each `+FLAG` sets options of our constructor (`FLAGS`).
Kept free of torch: the launcher and the reports read it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from benchmarks.configs import get_config

__all__ = [
    "BOUND",
    "CPU_UNSUPPORTED",
    "FLAGS",
    "NAMES",
    "SCHEDULES",
    "VARIANTS",
    "RunSpec",
    "parse_variant",
    "reference",
    "round_order",
]

_LIBRARIES = ("ours", "torchrec")
VARIANTS = ("plain", *(f"{lib}-{n}" for lib in _LIBRARIES for n in ("base", "sparse-dist", "prefetch")))
"""The loops `run` compares by default: the plain one, ours and torchrec's Base, SparseDist, Prefetch."""
_PAIRS = ("fused-sparse-dist", "semi-sync", "eval")
FAMILY = (*(f"{lib}-{n}" for n in _PAIRS for lib in _LIBRARIES), "ours-staged")
BOUND = ("compute-alone", "comm-alone", "io-alone")
NAMES = (*VARIANTS, *FAMILY, *BOUND)
SCHEDULES = ("adaptive", "early", "late", "early-shared", "late-own")
"""Our `InputDistOptions.schedule` values (repeated here to stay free of torch); "adaptive" is the default,
so `@adaptive` names it explicitly."""
FLAGS: dict[str, dict[str, bool]] = {
    "novote": {"ranks.agreement": False, "ranks.check_keys": False, "ranks.check_kjts": False},
    "nocheck": {"ranks.check_kjts": False},
    "noagree": {"ranks.agreement": False},
    "nokeys": {"ranks.check_keys": False},
    "inplace-copy": {"enable_inplace_copy_batch": True},
    "free-features": {"free_features_storage_early": True},
    "clear-inputs": {"clear_data_dist_inputs": True},
    "copy-after-forward": {"enqueue_batch_after_forward": True},
    "ahead": {"prefetch.prefetch_ahead": True},
    "inline": {"prefetch.prefetch_ahead": False},
    "wide": {"input_dist.narrow_ids": False},
    "narrow": {"input_dist.narrow_ids": True},
}
"""`+FLAG`: constructor options of our pipelines, "group.field" for a field of an options object
(`ranks=RankOptions(...)`, ...), else one of torchrec's parameters: the ranks' checks off, together
or one at a time, torchrec's memory flags, Prefetch's stage forced ahead or inline instead of its
watch, ids sent as made or as int32 wherever the tables allow (instead of the default's choice by
size)."""
_SCHEDULED = ("ours-sparse-dist", "ours-prefetch", "ours-fused-sparse-dist", "ours-semi-sync", "ours-eval")
"""Our classes that take `InputDistOptions.schedule`."""
CPU_UNSUPPORTED = ("torchrec-prefetch", "torchrec-fused-sparse-dist", "torchrec-semi-sync")
"""torchrec 1.8's pipelines that fail on CPU at their first steps; recorded as unsupported there."""


def parse_variant(variant: str) -> tuple[str, str | None, tuple[str, ...]]:
    """(name, forced schedule or None, flags) of `variant`.

    Raises:
        ValueError: not a variant; the message gives the grammar.
    """
    head, *flags = variant.split("+")
    name, _, schedule = head.partition("@")
    if (
        name not in NAMES
        or (schedule and (schedule not in SCHEDULES or name not in _SCHEDULED))
        or (flags and (not name.startswith("ours-") or name == "ours-staged"))
        or any(f not in FLAGS for f in flags)
    ):
        raise ValueError(
            f"unknown variant {variant!r}: NAME[@SCHEDULE][+FLAG...] with NAME one of {', '.join(NAMES)}; "
            f"@SCHEDULE ({', '.join(SCHEDULES)}) on {', '.join(_SCHEDULED)}; "
            f"+FLAG ({', '.join(FLAGS)}) on ours-* but ours-staged"
        )
    return name, schedule or None, tuple(flags)


def _tunes(variant: str, on_disk: bool) -> bool:
    """Whether `variant` measures before it decides: our Prefetch's watch where its `prefetch()` has
    work (tables on disk), unless `+ahead` or `+inline` forces the mode."""
    name, _, flags = parse_variant(variant)
    return name == "ours-prefetch" and on_disk and not {"ahead", "inline"} & set(flags)


def reference(variant: str) -> str | None:
    """What `variant` is compared with besides the plain loop: `X` for `X@S` or `X+F` (the same
    pipeline without the schedule or flag), torchrec's same class for `ours-X`; None otherwise."""
    name, schedule, flags = parse_variant(variant)
    if flags:
        return variant.rsplit("+", 1)[0]
    if schedule:
        return name
    twin = name.replace("ours-", "torchrec-", 1)
    return twin if name.startswith("ours-") and twin in NAMES else None


@dataclass(kw_only=True, slots=True)
class RunSpec:
    """What one launch runs; the same on every rank."""

    configs: tuple[str, ...]
    """Names from `benchmarks.configs.CONFIGS`."""
    variants: tuple[str, ...] = VARIANTS
    steps: int = 30
    """Timed steps per run."""
    warmup: int = 20
    """Untimed steps before them (first-batch rewrite, allocator warm-up)."""
    auto_warmup: int = 250
    """Untimed steps of every variant of a config where one of them measures before it decides: our
    Prefetch with tables on disk (its watch, docs/tiered.md, "Ahead or inline", decides 40-50 steps
    after the caches fill, about 100 steps into the `tiered` configs at one rank). Every variant of a
    config times the same steps of the same batches: with tables on disk, a variant timed earlier
    than another would be timed while its caches still fill, before evictions write rows back."""
    rounds: int = 4
    """Repetitions of every variant; the order is rotated between rounds."""
    profile_steps: int = 5
    """Steps of the separate profiled segment (input_dist wait inside forward, tensor peak); 0: none."""
    seed: int = 0
    device: str = "cpu"
    """`cpu` (gloo) or `cuda` (nccl, one GPU per rank)."""
    store_dir: str = ""
    """Where configs with tables on disk create their stores (a folder per config)."""
    trace_dir: str | None = None
    """Write each profiled segment's chrome trace here (readable by `python -m timeline`)."""
    cprofile: str | None = None
    """This variant's timed steps run under cProfile on rank 0 (its functions land in the record)."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.rounds < 1 or min(self.warmup, self.auto_warmup, self.profile_steps) < 0:
            raise ValueError(
                "--steps and --rounds must be positive, --warmup and --profile-steps not negative"
            )
        if not self.configs or not self.variants:
            raise ValueError("give at least one config and one variant")
        for name in self.configs:
            get_config(name)
        for variant in self.variants:
            parse_variant(variant)
        if self.cprofile is not None and self.cprofile not in self.variants:
            raise ValueError(f"--cprofile {self.cprofile}: not among the variants run")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")

    def warmup_of(self, config: str) -> int:
        """Untimed steps before the timed ones of every variant of `config` (`auto_warmup`). On CUDA
        a config's cached tables are torchrec's UVM cache, where Prefetch runs ahead without a watch."""
        on_disk = get_config(config).cache_fraction is not None and self.device == "cpu"
        return self.auto_warmup if any(_tunes(v, on_disk) for v in self.variants) else self.warmup

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
        raw = json.loads(text)
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})


def round_order(variants: tuple[str, ...], round_index: int) -> list[str]:
    """`variants` rotated so that each round starts with a different one, spread evenly."""
    shift = (round_index * max(1, len(variants) // 3)) % len(variants)
    return [*variants[shift:], *variants[:shift]]
