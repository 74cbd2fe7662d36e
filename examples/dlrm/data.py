"""Choose the train and eval data for a run: synthetic by default, Criteo TSV files with `data`.

Every rank gets iterators of its own `local batch size` samples per batch, and every rank gets the
same number of batches: the collectives of each step need all ranks to take it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torchrec.datasets.utils import Batch

from examples.dlrm.config import TrainConfig
from examples.dlrm.criteo_tsv import resolve_paths, tsv_batches
from examples.dlrm.synthetic import SyntheticSpec, synthetic_batches

__all__ = ["DataSources", "Positioned", "make_sources"]


@dataclass(kw_only=True, slots=True)
class DataSources:
    """Fresh iterators over this rank's share of the data."""

    train: Callable[[int, int], Positioned]
    """`train(epoch, start)`: the batches of one epoch from its batch `start` on."""
    eval: Callable[[], Iterator[Batch]] | None
    """`eval()`: the batches of one eval pass, the same every pass; None when eval is off."""
    steps_per_epoch: int | None
    """Batches per epoch when known in advance (synthetic data, or a `steps` cap)."""


def make_sources(config: TrainConfig, *, rank: int, world_size: int) -> DataSources:
    """Make this rank's data sources for `config`.

    Raises:
        InputError: the batch size does not divide by `world_size`, or a data file is missing or
            unreadable. Malformed lines raise it later, from the iterators.
    """
    batch_size = config.local_batch_size(world_size)
    spec = SyntheticSpec(table_sizes=config.table_sizes, pooling=config.pooling, seed=config.seed)
    if config.data is None:

        def train(epoch: int, start: int = 0) -> Positioned:
            # Every epoch is the same data, as with files.
            batches = synthetic_batches(
                spec, batch_size=batch_size, num_batches=config.steps, rank=rank, start=start
            )
            return Positioned(batches, epoch=epoch, batch=start)

        steps: int | None = config.steps
    else:
        paths = resolve_paths(config.data)

        def train(epoch: int, start: int = 0) -> Positioned:
            batches = tsv_batches(
                paths,
                table_sizes=config.table_sizes,
                batch_size=batch_size,
                rank=rank,
                world_size=world_size,
                max_batches=config.steps,
            )
            # Reads (and checks) the lines of the batches skipped: resuming costs one pass over them.
            return Positioned(itertools.islice(batches, start, None), epoch=epoch, batch=start)

        steps = config.steps or None

    eval_paths = resolve_paths(config.eval_data) if config.eval_data else None

    def evaluate() -> Iterator[Batch]:
        if eval_paths is None:
            return synthetic_batches(
                spec, batch_size=batch_size, num_batches=config.eval_batches, rank=rank, stream="eval"
            )
        return tsv_batches(
            eval_paths,
            table_sizes=config.table_sizes,
            batch_size=batch_size,
            rank=rank,
            world_size=world_size,
            max_batches=config.eval_batches,
        )

    return DataSources(train=train, eval=evaluate if config.eval_every else None, steps_per_epoch=steps)


class Positioned:
    """An iterator over one epoch's batches whose `state_dict()` is its position, `{"epoch": e,
    "batch": b}` with `b` the index of the next batch of the epoch (a stateful dataloader's
    contract, which the pipelines' `dataloader_state()` reads). The position counts global batches,
    so it means the same at any world size."""

    def __init__(self, batches: Iterator[Batch], *, epoch: int, batch: int) -> None:
        self._batches = batches
        self._epoch, self._batch = epoch, batch

    def __iter__(self) -> Positioned:
        return self

    def __next__(self) -> Batch:
        item = next(self._batches)
        self._batch += 1
        return item

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "batch": self._batch}
