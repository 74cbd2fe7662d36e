"""Read Criteo Kaggle/Terabyte TSV files into batches, each rank its own share of every batch.

A line is `label, 13 integer features, 26 categorical features` separated by tabs; any feature may
be empty (an empty count reads as 0, an empty categorical as no id). Categoricals are hex strings,
hashed into their table by `int(hex, 16) % table_size`.

Sharing: the files, in the order given (a glob is sorted), are cut into global batches of
`batch_size * world_size` consecutive lines, and rank r takes the r-th slice of `batch_size` lines
of each. Every rank reads every line but parses only its own; a last, incomplete global batch is
dropped. So every rank yields the same number of batches, which the collectives of each step need
(a rank that ran out first would leave the others waiting forever). Every rank checks the column
count of every line, so that a malformed line stops all ranks with the same message.
"""

from __future__ import annotations

import glob
from collections.abc import Iterator
from pathlib import Path

import torch
from torchrec.datasets.utils import Batch

from examples.dlrm.config import NUM_DENSE, NUM_SPARSE, InputError
from examples.dlrm.features import make_batch

__all__ = ["resolve_paths", "tsv_batches"]

_COLUMNS = 1 + NUM_DENSE + NUM_SPARSE
_Row = tuple[int, list[int], list[int]]  # label, counts, ids in their tables (-1: empty field)


def resolve_paths(pattern: str) -> list[Path]:
    """The readable files that `pattern` (a path or a glob) names, sorted.

    Raises:
        InputError: nothing matches, or a match is not a readable file.
    """
    if glob.has_magic(pattern):
        paths = sorted(Path(p) for p in glob.glob(pattern))
        if not paths:
            raise InputError(f"no data file matches {pattern!r}")
    else:
        paths = [Path(pattern)]
    for path in paths:
        if not path.is_file():
            raise InputError(f"data file {str(path)!r} does not exist or is not a file")
        try:
            with path.open("rb") as f:
                f.read(1)
        except OSError as e:
            raise InputError(f"cannot read data file {str(path)!r}: {e.strerror}") from e
    return paths


def tsv_batches(
    paths: list[Path],
    *,
    table_sizes: tuple[int, ...],
    batch_size: int,
    rank: int,
    world_size: int,
    max_batches: int = 0,
) -> Iterator[Batch]:
    """Yield this rank's batches of `batch_size` samples from `paths`.

    Args:
        paths: files, read in this order.
        table_sizes: rows of each of the 26 tables.
        batch_size: samples per rank per batch.
        rank: this rank.
        world_size: number of ranks sharing the files.
        max_batches: stop after this many batches; 0 reads to the end.

    Raises:
        InputError: a file cannot be read or a line is malformed (the message names file and line).
    """
    group = batch_size * world_size
    mine = range(rank * batch_size, (rank + 1) * batch_size)
    rows: list[_Row] = []
    position, produced = 0, 0
    for path, lineno, fields in _lines(paths):
        if position in mine:
            rows.append(_parse(fields, path, lineno, table_sizes))
        position += 1
        if position == group:
            yield _to_batch(rows)
            rows, position, produced = [], 0, produced + 1
            if produced == max_batches:
                return


def _lines(paths: list[Path]) -> Iterator[tuple[Path, int, list[str]]]:
    for path in paths:
        try:
            with path.open(encoding="utf-8", newline="\n") as f:
                for lineno, line in enumerate(f, start=1):
                    line = line.rstrip("\r\n")
                    if not line:
                        continue  # a blank line, typically at the end of a file
                    fields = line.split("\t")
                    if len(fields) != _COLUMNS:
                        raise InputError(
                            f"{path}:{lineno}: expected {_COLUMNS} tab-separated columns (label, "
                            f"{NUM_DENSE} integer and {NUM_SPARSE} categorical features), "
                            f"found {len(fields)}",
                            every_rank=True,
                        )
                    yield path, lineno, fields
        except OSError as e:
            raise InputError(f"cannot read data file {str(path)!r}: {e.strerror}", every_rank=True) from e
        except UnicodeDecodeError as e:
            message = f"{path}: not UTF-8 text ({e.reason}); is it compressed?"
            raise InputError(message, every_rank=True) from e


def _parse(fields: list[str], path: Path, lineno: int, table_sizes: tuple[int, ...]) -> _Row:
    try:
        label = int(fields[0])
        if label not in (0, 1):
            raise ValueError(f"label {label} is not 0 or 1")
        counts = [int(v) if v else 0 for v in fields[1 : 1 + NUM_DENSE]]
        cats = fields[1 + NUM_DENSE :]
        ids = [int(v, 16) % size if v else -1 for v, size in zip(cats, table_sizes, strict=True)]
    except ValueError as e:
        raise InputError(f"{path}:{lineno}: malformed field: {e}") from e
    return label, counts, ids


def _to_batch(rows: list[_Row]) -> Batch:
    labels = torch.tensor([label for label, _, _ in rows], dtype=torch.int64)
    counts = torch.tensor([counts for _, counts, _ in rows], dtype=torch.int64)
    ids = torch.tensor([ids for _, _, ids in rows], dtype=torch.int64).T  # (26, B), -1: missing
    present = ids >= 0
    # Boolean indexing walks (feature, sample) in row-major order: the key-major order of a KJT.
    return make_batch(counts, present.long(), ids[present], labels)
