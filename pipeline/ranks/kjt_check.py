"""The per-batch checks of a batch's KeyedJaggedTensors at fetch, before they enter a collective.

`KeyCheck`: each batch's KJT keys against the first batch's. torchrec's input_dist builds its
feature order from the keys of the first batch it sees and does not look at them again, so a later
batch with a feature renamed, missing or added would be embedded under the wrong tables without a
word. A batch that fails the check gets the status `BAD_KEYS`, and every rank stops before it with
the same `BatchKeysError`.

`KJTCheck`: each batch's KJTs are well formed. torchrec validates the first batch a sharded module
sees and no other; a later batch whose lengths do not add up to its values, with a negative length,
or with an id past its table's last row fails deep inside input_dist or the lookup kernel, on one
rank, while the others wait for it. Here every batch is checked with a few reductions over its
tensors (no Python loop; microseconds on the host, a synchronization each for a batch already on a
GPU), and a bad one gets the status `MALFORMED`: every rank stops before it with the same
`MalformedBatchError` naming the batch, the key and the problem (the loops below run only then).

Both look each KJT up at the first batch's paths (`kjt_at`): a walk of the whole batch costs ~60 us.
What `KJTCheck` proves of a batch's ids and lengths (`InRange`) spares the narrowing its own pass.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from rewrite import find_kjts

__all__ = ["InRange", "KJTCheck", "KeyCheck", "Table", "kjt_at", "table_configs", "tables_of"]

_NO_LIMIT = torch.iinfo(torch.int64).max
_INT32_END = 2**31


class InRange:
    """The tensors a check proved to hold only values in [0, 2^31), by identity, while they live.

    The narrowing (`pipeline.stages.narrow`) casts such a tensor to int32 without its own pass for
    the minimum and maximum: on a network-bound CPU job that pass is ~3 % of the step. A tensor
    changed in place after the check would keep its proof; the pipeline narrows a batch before the
    model runs on it, and nothing between the check and the narrowing writes to the batch.
    """

    def __init__(self) -> None:
        self._tensors: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        """By id; an entry goes when its tensor dies (before its id can be reused)."""

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
    """The table each feature of `model`'s embedding modules (sharded or not) looks up.

    A feature that feeds several tables of one module gets the smallest (an id must fit all of
    them); one named by several modules gets the largest, since which KeyedJaggedTensor of the
    batch feeds which module is not known here (no false alarm, at the price of a missed one).
    Features of managed-collision modules (raw ids, remapped before the lookup) and of virtual
    tables (hashed ids of any size) are left out.
    """
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
    """The table configs `module` itself holds (not its children's): an embedding module's,
    sharded or not; [] for any other module."""
    # torchrec's sharded modules keep their tables' configs only under these (private) names; the
    # unsharded ones have public accessors
    for attr in ("_embedding_bag_configs", "_embedding_configs"):
        configs = getattr(module, attr, None)
        if isinstance(configs, list):
            return configs
    for method in ("embedding_bag_configs", "embedding_configs"):
        if callable(accessor := getattr(module, method, None)):
            return list(accessor())
    return []


class KJTCheck:
    """Checks every KeyedJaggedTensor of a batch: lengths, values, weights and ids.

    The tables are read from `model` at the first batch, and the KJTs are found at the first
    batch's paths (a walk of the whole batch costs ~60 us; a look-up at known paths a few).

    Args:
        model: the model the pipeline trains (its embedding modules' configs give the tables).
    """

    def __init__(self, model: nn.Module | None) -> None:
        self._model = model
        self._tables: dict[str, Table] | None = None
        self._paths: list[Any] | None = None
        self._limits: dict[tuple[str, ...], tuple[torch.Tensor, int | None, bool]] = {}
        self.in_int32 = InRange()
        """The ids and lengths of the KJTs that passed, where each table has fewer than 2^31 rows."""

    def check(self, batch: Any) -> str | None:
        """None if every KeyedJaggedTensor of `batch` is well formed; else what is wrong with the
        first bad one (its path, key and problem)."""
        if self._paths is None:
            self._tables = tables_of(self._model) if self._model is not None else {}
            self._paths = [(str(path), path) for path, _ in find_kjts(batch)]
        for text, path in self._paths:
            kjt = kjt_at(batch, path)
            if kjt is not None and (problem := self.check_kjt(kjt)) is not None:
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
            key, sample = _locate(keys, strides, at)
            return f"key {key!r}: negative length {int(lengths[at])} at sample {sample}"
        total = int(lengths.sum())
        if total != n:
            return _sum_problem(keys, _per_key(lengths, strides), n)
        weights = kjt.weights_or_none()
        if weights is not None and weights.numel() != n:
            return f"keys {keys}: {weights.numel()} weights for {n} values"
        if not n:
            return None
        limits, uniform, in_int32 = self._limits.get(tuple(keys)) or self._limits_of(keys)
        problem = None
        if uniform is None or not self._in_uniform(values, uniform):
            problem = self._range_problem(keys, values, lengths, strides, limits, uniform)
        if problem is None and in_int32 and n < _INT32_END:
            self.in_int32.add(values)  # ids below their tables' rows; lengths at most n
            self.in_int32.add(lengths)
        return problem

    @staticmethod
    def _in_uniform(values: torch.Tensor, uniform: int) -> bool:
        """Every id in [0, uniform) (one pass, where every key's table has the same rows)."""
        low, high = torch.aminmax(values)
        return int(low) >= 0 and int(high) < uniform

    def _range_problem(
        self,
        keys: list[str],
        values: torch.Tensor,
        lengths: torch.Tensor,
        strides: list[int],
        limits: torch.Tensor,
        uniform: int | None,
    ) -> str | None:
        if uniform is not None:
            per_value = torch.full_like(values, uniform, dtype=torch.int64)
        else:
            per_key = _per_key(lengths, strides)
            per_value = torch.repeat_interleave(limits, torch.tensor(per_key), output_size=values.numel())
        bad = (values < 0) | (values >= per_value)
        if not bool(bad.any()):
            return None
        at = int(bad.nonzero()[0])
        key_index, sample = _value_owner(lengths, strides, at)
        table = self._tables.get(keys[key_index]) if self._tables else None
        where = f"the {table.rows} rows of table {table.name!r}" if table else "every table's rows (below 0)"
        return f"key {keys[key_index]!r}: id {int(values[at])} at sample {sample} is outside {where}"

    def _limits_of(self, keys: list[str]) -> tuple[torch.Tensor, int | None, bool]:
        """Per key, the rows of its table (no limit for a key with no table); the common value if
        every key has a table of the same rows; whether every key's table has at most 2^31 rows
        (kept per key list)."""
        rows = [self._tables[k].rows if self._tables and k in self._tables else _NO_LIMIT for k in keys]
        uniform = rows[0] if rows and len(set(rows)) == 1 and rows[0] != _NO_LIMIT else None
        limits = torch.tensor(rows, dtype=torch.int64)
        cached = self._limits[tuple(keys)] = (limits, uniform, max(rows, default=0) <= _INT32_END)
        return cached


class KeyCheck:
    """Compares each batch's KeyedJaggedTensor keys, per path in the batch, with the first batch's.

    Walking the whole batch for KeyedJaggedTensors costs ~60 us on a busy core, most of the check;
    so later batches are first looked up at the first batch's paths (a few us), and walked only if
    one differs, for the error's details. A KeyedJaggedTensor at a path the first batch did not
    have is not looked for: the model reads none there.
    """

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
    """The KeyedJaggedTensor at `path` (an ArgInfo of the first batch) in `batch`; None if this
    batch has none there (another shape: the key check reports it)."""
    try:
        found = path.read(batch)
    except (AttributeError, KeyError, IndexError, TypeError):
        return None
    return found if isinstance(found, KeyedJaggedTensor) else None


def _per_key(lengths: torch.Tensor, strides: list[int]) -> list[int]:
    """The number of values of each key."""
    if len(set(strides)) > 1:  # variable batch per key
        return [int(part.sum()) for part in torch.split(lengths, strides)]
    return _sums(lengths, strides)


def _sums(lengths: torch.Tensor, strides: list[int]) -> list[int]:
    if not strides:
        return []
    return lengths.view(len(strides), strides[0]).sum(1).tolist() if strides[0] else [0] * len(strides)


def _locate(keys: list[str], strides: list[int], at: int) -> tuple[str, int]:
    """The key and sample of entry `at` of the lengths."""
    for key, stride in zip(keys, strides, strict=True):
        if at < stride:
            return key, at
        at -= stride
    raise IndexError(at)


def _value_owner(lengths: torch.Tensor, strides: list[int], at: int) -> tuple[int, int]:
    """(key index, sample) of value `at` (lengths known non-negative and summing to the values)."""
    entry = int(torch.searchsorted(torch.cumsum(lengths, 0), at, right=True))
    for index, stride in enumerate(strides):
        if entry < stride:
            return index, entry
        entry -= stride
    raise IndexError(at)


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
