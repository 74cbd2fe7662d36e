"""The checks of a batch's KeyedJaggedTensors at fetch, before they enter a collective (torchrec
checks only the first batch): `KeyCheck` (keys) and `KJTCheck` (lengths, weights and ids, in a few
reductions), both reading each KJT at the first batch's paths (`kjt_at`): walking a batch costs ~60 us."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from rewrite import find_kjts

__all__ = ["InRange", "KJTCheck", "KeyCheck", "Table", "kjt_at", "table_configs", "tables_of"]

_INT32_END = 2**31


class InRange:
    """Tensors a check proved to hold only values in [0, 2^31), by identity while they live, so that
    the narrowing casts them unchecked; nothing writes to the batch between the check and the narrowing."""

    def __init__(self) -> None:
        # by id; an entry goes when its tensor dies, before its id can be reused
        self._tensors: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

    def add(self, tensor: torch.Tensor) -> None:
        self._tensors[id(tensor)] = tensor

    def __contains__(self, tensor: torch.Tensor) -> bool:
        return self._tensors.get(id(tensor)) is tensor


@dataclass(frozen=True, slots=True)
class Table:
    """The table a feature's ids index."""

    name: str
    rows: int


def tables_of(model: nn.Module) -> dict[str, Table]:
    """The table each feature of `model`'s embedding modules looks up: of one module's tables the
    smallest, of several modules' the largest (no false alarm); managed-collision and virtual ones skipped."""
    remapped = [name for name, m in model.named_modules() if "ManagedCollision" in type(m).__name__]
    found: dict[str, Table] = {}
    for name, module in model.named_modules():
        if any(name == r or name.startswith(f"{r}.") for r in remapped):
            continue
        per_module: dict[str, Table] = {}
        for config in table_configs(module):
            if getattr(config, "use_virtual_table", False):
                continue
            table = Table(config.name, int(config.num_embeddings))
            for feature in config.feature_names:
                if feature not in per_module or table.rows < per_module[feature].rows:
                    per_module[feature] = table
        for feature, table in per_module.items():
            if feature not in found or table.rows > found[feature].rows:
                found[feature] = table
    return found


def table_configs(module: nn.Module) -> list[Any]:
    """The table configs `module` itself holds (not its children's); [] for a non-embedding module."""
    # torchrec's sharded modules keep them only under these private names; unsharded ones have accessors
    for attr in ("_embedding_bag_configs", "_embedding_configs"):
        configs = getattr(module, attr, None)
        if isinstance(configs, list):
            return configs
    for method in ("embedding_bag_configs", "embedding_configs"):
        if callable(accessor := getattr(module, method, None)):
            return list(accessor())
    return []


class KJTCheck:
    """Checks every KeyedJaggedTensor of a batch (lengths, values, weights and ids), the tables read
    from `model`'s embedding modules at the first batch."""

    def __init__(self, model: nn.Module | None) -> None:
        self._model = model
        self._tables: dict[str, Table] | None = None
        self._paths: list[Any] | None = None
        self._limits: dict[tuple[str, ...], tuple[torch.Tensor, torch.Tensor, int | None, bool]] = {}
        self.in_int32 = InRange()  # the ids and lengths that passed, every table below 2^31 rows
        self.untabled: set[str] = set()  # features seen without a table: ids checked in [0, 2^31) only

    def check(self, batch: Any) -> str | None:
        """None if every KeyedJaggedTensor of `batch` is well formed; else the first bad one's path,
        key and problem. A batch without one at a first batch's path is walked whole."""
        if self._paths is None:
            self._tables = tables_of(self._model) if self._model is not None else {}
            self._paths = [(str(path), path) for path, _ in find_kjts(batch)]
        found = []
        for text, path in self._paths:
            kjt = kjt_at(batch, path)
            if kjt is None:  # not where the first batch had one: walk this batch whole
                found = [(str(path), kjt) for path, kjt in find_kjts(batch)]
                break
            found.append((text, kjt))
        for text, kjt in found:
            if (problem := self.check_kjt(kjt)) is not None:
                return f"the KeyedJaggedTensor at {text or 'the batch'}, {problem}"
        return None

    def check_kjt(self, kjt: KeyedJaggedTensor) -> str | None:
        """None if `kjt` is well formed; else its bad key and what is wrong."""
        keys, values, lengths = kjt.keys(), kjt.values(), kjt.lengths()
        strides = kjt.stride_per_key()
        n = values.numel()
        if lengths.numel() != sum(strides):
            split = f"{len(keys)} keys of {strides} samples"
            return f"keys {keys}: {lengths.numel()} lengths do not split into {split}"
        if lengths.numel() and int(lengths.min()) < 0:
            at = int((lengths < 0).nonzero()[0])
            key_index, sample = _locate(strides, at)
            return f"key {keys[key_index]!r}: negative length {int(lengths[at])} at sample {sample}"
        total = int(lengths.sum())
        if total != n:
            return _sum_problem(keys, _per_key(lengths, strides), n)
        weights = kjt.weights_or_none()
        if weights is not None and weights.numel() != n:
            return f"keys {keys}: {weights.numel()} weights for {n} values"
        if not n:
            return None
        limits, tabled_keys, uniform, in_int32 = self._limits.get(tuple(keys)) or self._limits_of(keys)
        in_range = False
        if uniform is not None:  # one bound for every key: a min and a max decide
            low, high = torch.aminmax(values)
            in_range = int(low) >= 0 and int(high) < uniform
        if not in_range:  # find the first id outside its table, per key
            per_key = torch.tensor(_per_key(lengths, strides))
            over = values >= torch.repeat_interleave(limits, per_key, output_size=n)
            tabled = torch.repeat_interleave(tabled_keys, per_key, output_size=n)
            bad = (values < 0) | (over & tabled)
            if bool(bad.any()):
                at = int(bad.nonzero()[0])
                entry = int(torch.searchsorted(torch.cumsum(lengths, 0), at, right=True))  # `at`'s length
                key_index, sample = _locate(strides, entry)
                table = self._tables.get(keys[key_index]) if self._tables else None
                where = f"the {table.rows} rows of table {table.name!r}" if table else "every table (below 0)"
                return f"key {keys[key_index]!r}: id {int(values[at])} at sample {sample} is outside {where}"
            # past 2^31, a feature without a table has no problem, but no proof
            in_range = not bool((over & ~tabled).any())
        if in_range and in_int32 and n < _INT32_END:
            self.in_int32.add(values)  # ids below their tables' rows (or 2^31); lengths at most n
            self.in_int32.add(lengths)
        return None

    def _limits_of(self, keys: list[str]) -> tuple[torch.Tensor, torch.Tensor, int | None, bool]:
        """Per key, its table's rows (2^31 without a table) and whether it has one; the rows shared
        by every key's table, if any; whether every table has at most 2^31 rows. Cached per keys."""
        untabled = [k for k in keys if not (self._tables and k in self._tables)]
        self.untabled.update(untabled)
        rows = [_INT32_END if k in untabled else self._tables[k].rows for k in keys]
        uniform = rows[0] if rows and len(set(rows)) == 1 and not untabled else None
        limits = torch.tensor(rows, dtype=torch.int64)
        tabled = torch.tensor([k not in untabled for k in keys])
        cached = self._limits[tuple(keys)] = (limits, tabled, uniform, max(rows, default=0) <= _INT32_END)
        return cached


class KeyCheck:
    """Compares each batch's KeyedJaggedTensor keys, per path, with the first batch's (a KJT at a path
    the first batch did not have is not looked for: the model reads none there)."""

    def __init__(self) -> None:
        self.expected: list[tuple[str, list[str]]] | None = None
        self._paths: list[tuple[Any, list[str]]] = []

    @staticmethod
    def keys_of(batch: Any) -> list[tuple[str, list[str]]]:
        return [(str(path), list(kjt.keys())) for path, kjt in find_kjts(batch)]

    def check(self, batch: Any) -> list[tuple[str, list[str]]] | None:
        """None if `batch` has the expected keys (or is the first); else the keys it has."""
        if self.expected is None:
            self._paths = [(path, list(kjt.keys())) for path, kjt in find_kjts(batch)]
            self.expected = [(str(path), keys) for path, keys in self._paths]
            return None
        for path, keys in self._paths:
            kjt = kjt_at(batch, path)
            if kjt is None or kjt.keys() != keys:
                break  # walk the whole batch, for the error's details
        else:
            if self._paths:  # a first batch without any: every batch is walked
                return None
        found = self.keys_of(batch)
        return None if found == self.expected else found


def kjt_at(batch: Any, path: Any) -> KeyedJaggedTensor | None:
    """The KeyedJaggedTensor at `path` (an ArgInfo of the first batch) in `batch`; None if none there."""
    try:
        found = path.read(batch)
    except (AttributeError, KeyError, IndexError, TypeError):
        return None
    return found if isinstance(found, KeyedJaggedTensor) else None


def _per_key(lengths: torch.Tensor, strides: list[int]) -> list[int]:
    if len(set(strides)) > 1:  # variable batch per key
        return [int(part.sum()) for part in torch.split(lengths, strides)]
    if not strides:
        return []
    return lengths.view(len(strides), strides[0]).sum(1).tolist() if strides[0] else [0] * len(strides)


def _locate(strides: list[int], entry: int) -> tuple[int, int]:
    """(key index, sample) of entry `entry` of the lengths."""
    for index, stride in enumerate(strides):
        if entry < stride:
            return index, entry
        entry -= stride
    raise IndexError(entry)


def _sum_problem(keys: list[str], per_key: list[int], n: int) -> str:
    end = 0
    for key, count in zip(keys, per_key, strict=True):
        start, end = end, end + count
        if end > n:
            return f"key {key!r}: its lengths ask for values {start} to {end - 1}, but there are {n} values"
    last = keys[-1]
    return (
        f"key {last!r}: the lengths end at value {end}, but there are {n} values (the rest belong to no key)"
    )
