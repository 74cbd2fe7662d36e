"""The key check: each batch's KeyedJaggedTensor keys against the first batch's.

torchrec's input_dist builds its feature order from the keys of the first batch it sees and does not
look at them again, so a later batch with a feature renamed, missing or added would be embedded
under the wrong tables without a word. A batch that fails the check gets the status `BAD_KEYS`,
and every rank stops before it with the same `BatchKeysError`.
"""

from __future__ import annotations

from typing import Any

from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from rewrite import find_kjts

__all__ = ["KeyCheck", "kjt_at"]


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
            found = find_kjts(batch)
            self._paths = [(path, list(kjt.keys())) for path, kjt in found]
            self.expected = [(str(path), keys) for path, keys in self._paths]
            return None
        if self._paths and all(self._has_keys(batch, path, keys) for path, keys in self._paths):
            return None
        found = self.keys_of(batch)
        return None if found == self.expected else found

    @staticmethod
    def _has_keys(batch: Any, path: Any, keys: list[str]) -> bool:
        kjt = kjt_at(batch, path)
        return kjt is not None and kjt.keys() == keys


def kjt_at(batch: Any, path: Any) -> KeyedJaggedTensor | None:
    """The KeyedJaggedTensor at `path` (an ArgInfo of the first batch) in `batch`; None if this
    batch has none there (another shape: the key check reports it)."""
    try:
        found = path.resolve(batch)
    except (AttributeError, KeyError, IndexError, TypeError):
        return None
    return found if isinstance(found, KeyedJaggedTensor) else None
