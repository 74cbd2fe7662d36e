"""The Criteo feature layout shared by the synthetic source and the TSV reader.

A sample is a label, 13 non-negative integer counts and 26 categorical features. Both sources turn
raw rows into the same `torchrec.datasets.utils.Batch`, so a TSV written from synthetic rows reads
back as the very same batch: dense features are `log(1 + count)`, sparse features a
`KeyedJaggedTensor` keyed `cat_0`..`cat_25` (key-major, as torchrec expects) and labels int64.
"""

from __future__ import annotations

import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from examples.dlrm.config import NUM_DENSE, NUM_SPARSE

__all__ = ["DENSE_NAMES", "SPARSE_NAMES", "make_batch"]

DENSE_NAMES = tuple(f"int_{i}" for i in range(NUM_DENSE))
SPARSE_NAMES = tuple(f"cat_{i}" for i in range(NUM_SPARSE))


def make_batch(
    counts: torch.Tensor, lengths: torch.Tensor, values: torch.Tensor, labels: torch.Tensor
) -> Batch:
    """Build a Batch from raw rows.

    Args:
        counts: (B, 13) integer counts; negatives (Criteo has a few) are clamped to 0.
        lengths: (26, B) ids per feature per sample, key-major.
        values: all ids, key-major then sample-major, already reduced to each table's size.
        labels: (B,) zeros and ones.

    Returns:
        The batch, on CPU; the pipelines copy it to the device.
    """
    dense = torch.log1p(counts.clamp(min=0).to(torch.float32))
    sparse = KeyedJaggedTensor.from_lengths_sync(
        keys=list(SPARSE_NAMES),
        values=values.to(torch.int64),
        lengths=lengths.reshape(-1).to(torch.int32),
    )
    return Batch(dense_features=dense, sparse_features=sparse, labels=labels.to(torch.int64))
