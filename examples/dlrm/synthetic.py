"""A synthetic Criteo-like source: 13 heavy-tailed counts, 26 power-law sparse features, and labels
that depend on both, so that loss falls and AUC rises as the model learns.

Each batch is drawn from its own generator, seeded by (seed, stream, rank, batch index): batches are
the same for the same seed on every run and every epoch, and differ between ranks and between the
train and eval streams. The hidden "teacher" that makes labels depends on the seed only, so that
every rank and stream learns the same task. `write_tsv` writes the same rows in the Criteo TSV
format, which the TSV reader turns back into the same batch.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torchrec.datasets.utils import Batch

from examples.dlrm.config import NUM_DENSE, NUM_SPARSE
from examples.dlrm.features import make_batch

__all__ = ["SyntheticSpec", "synthetic_batches", "write_tsv"]

# Multiplying by a prime above every table size permutes [0, N), which scatters the hot ids of the
# power law over the table instead of piling them at row 0 (hashed real ids look like this).
_SCATTER_PRIME = 2_654_435_761


@dataclass(kw_only=True, slots=True)
class SyntheticSpec:
    """The distribution synthetic samples are drawn from."""

    table_sizes: tuple[int, ...]
    """Rows of each of the 26 tables; ids are drawn below these."""
    pooling: int = 1
    """Mean ids per feature per sample; lengths are uniform in [1, 2 * pooling - 1]."""
    missing_rate: float = 0.0
    """Chance that a feature of a sample is missing (count 0, or no ids)."""
    seed: int = 0
    """Seeds the teacher and every batch."""

    def __post_init__(self) -> None:
        if len(self.table_sizes) != NUM_SPARSE or self.pooling < 1:
            raise ValueError("need 26 table sizes and pooling >= 1")
        if max(self.table_sizes) >= _SCATTER_PRIME:
            raise ValueError(f"table sizes must be below {_SCATTER_PRIME}")


def synthetic_batches(
    spec: SyntheticSpec,
    *,
    batch_size: int,
    num_batches: int,
    rank: int,
    stream: str = "train",
    start: int = 0,
) -> Iterator[Batch]:
    """Yield batches `start` to `num_batches - 1` of `batch_size` samples for `rank` on `stream`."""
    for index in range(start, num_batches):
        gen = torch.Generator().manual_seed(_batch_seed(spec.seed, stream, rank, index))
        yield make_batch(*_sample_rows(spec, gen, batch_size))


def write_tsv(path: str | Path, spec: SyntheticSpec, num_lines: int) -> None:
    """Write the rows of `synthetic_batches(spec, batch_size=num_lines, num_batches=1, rank=0)` as
    a Criteo TSV file (label, 13 counts, 26 ids as 8 hex digits; missing fields empty)."""
    if spec.pooling != 1:
        raise ValueError("a TSV line holds one id per feature: write with pooling=1")
    gen = torch.Generator().manual_seed(_batch_seed(spec.seed, "train", 0, 0))
    counts, lengths, values, labels = _sample_rows(spec, gen, num_lines)
    ids = torch.full((NUM_SPARSE, num_lines), -1, dtype=torch.int64)
    ids[lengths.bool()] = values  # with pooling 1, values fill the present slots in key-major order
    lines = []
    for i, row in enumerate(ids.T.tolist()):
        # Criteo writes both "0" and empty fields; empty reads back as 0, so use both.
        dense = ["" if c == 0 and i % 2 else str(c) for c in counts[i].tolist()]
        cats = [f"{v:08x}" if v >= 0 else "" for v in row]
        lines.append("\t".join([str(int(labels[i])), *dense, *cats]) + "\n")
    Path(path).write_text("".join(lines))


def _batch_seed(seed: int, stream: str, rank: int, index: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{stream}/{rank}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # manual_seed wants a non-negative int64


def _sample_rows(
    spec: SyntheticSpec, gen: torch.Generator, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    scales, dense_w = _teacher(spec.seed)
    # Exponential counts with per-feature scales from 1 to 1000: heavy-tailed like Criteo's.
    counts = torch.floor(-torch.log1p(-torch.rand(n, NUM_DENSE, generator=gen)) * scales).long()
    counts[torch.rand(n, NUM_DENSE, generator=gen) < spec.missing_rate] = 0
    if spec.pooling == 1:
        lengths = torch.ones(NUM_SPARSE, n, dtype=torch.int64)
    else:
        lengths = torch.randint(1, 2 * spec.pooling, (NUM_SPARSE, n), generator=gen)
    lengths[torch.rand(NUM_SPARSE, n, generator=gen) < spec.missing_rate] = 0
    values, effect = [], torch.zeros(n)
    for k, size in enumerate(spec.table_sizes):
        ids = _power_law_ids(gen, int(lengths[k].sum()), size)
        values.append(ids)
        sample = torch.repeat_interleave(torch.arange(n), lengths[k])
        effect.index_add_(0, sample, _id_effect(ids, k) / spec.pooling)
    z = torch.log1p(counts.float()) - torch.log(scales)
    logit = z @ dense_w + effect * (2.0 / math.sqrt(NUM_SPARSE)) - 1.0
    labels = (torch.rand(n, generator=gen) < torch.sigmoid(logit)).long()
    return counts, lengths, torch.cat(values), labels


def _power_law_ids(gen: torch.Generator, count: int, size: int) -> torch.Tensor:
    # floor(size ** u) - 1 for uniform u gives P(rank k) ~ 1 / (k + 1): Zipf with exponent 1.
    u = torch.rand(count, generator=gen, dtype=torch.float64)
    ranks = (torch.exp(u * math.log(size)).floor().long() - 1).clamp_(0, size - 1)
    return ranks * _SCATTER_PRIME % size


def _id_effect(ids: torch.Tensor, feature: int) -> torch.Tensor:
    # A fixed pseudo-random score in [-1, 1) per (feature, id): what the embeddings must learn.
    mixed = (ids * 40_503 + feature * 9_973) % 1_021
    return mixed.float() / 510.5 - 1.0


def _teacher(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    scales = torch.logspace(0, 3, NUM_DENSE)
    dense_w = torch.randn(NUM_DENSE, generator=gen) * (1.5 / math.sqrt(NUM_DENSE))
    return scales, dense_w
