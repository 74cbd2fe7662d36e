"""Find ArgInfos by looking for KeyedJaggedTensors inside a sample batch.

Every KJT reachable from the batch through dataclass fields, attributes, dict values and list/tuple
items is listed with its path. A sharded module is matched to the KJT whose keys are exactly the
feature names its tables expect (or, failing that, the only KJT holding all of them). No attribute
name is special. This is the fallback when the forward cannot be traced: it cannot see a KJT that the
model transforms before the sharded module, so such models need explicit paths.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from rewrite.arginfo import ArgInfo, Attr, CallArgs, Item, Step

__all__ = ["children", "expected_features", "find_kjts", "match_direct"]

_MAX_DEPTH = 8


def find_kjts(batch: Any) -> list[tuple[ArgInfo, KeyedJaggedTensor]]:
    """Every KeyedJaggedTensor in `batch` with the path that reaches it, in traversal order."""
    return [(ArgInfo(tuple(steps)), kjt) for steps, kjt in _walk(batch, [], 0, set())]


def _walk(value: Any, steps: list[Step], depth: int, seen: set[int]) -> Iterator:
    if isinstance(value, KeyedJaggedTensor):
        yield steps, value
        return
    if depth >= _MAX_DEPTH or isinstance(value, (torch.Tensor, str, bytes, int, float)):
        return
    if id(value) in seen:
        return
    seen.add(id(value))
    for step, child in children(value):
        yield from _walk(child, [*steps, step], depth + 1, seen)


def children(value: Any) -> Iterator[tuple[Step, Any]]:
    """The step to each value directly inside `value` (dict items, list/tuple items, dataclass
    fields, public attributes), with the value."""
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, (str, int)):
                yield Item(k), v
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield Item(i), v
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield Attr(f.name), getattr(value, f.name)
    elif hasattr(value, "__dict__") and not isinstance(value, (nn.Module, type)):
        for name, v in vars(value).items():
            if not name.startswith("_"):
                yield Attr(name), v


def expected_features(module: nn.Module) -> list[str] | None:
    """The feature names a sharded embedding module expects, from its table configs; None if unknown."""
    for name in ("_embedding_bag_configs", "_embedding_configs"):
        configs = getattr(module, name, None)
        if isinstance(configs, list) and configs and isinstance(configs[0], BaseEmbeddingConfig):
            return [f for c in configs for f in c.feature_names]
    for child in module.children():  # e.g. a feature-processed EBC wraps an EBC
        found = expected_features(child)
        if found is not None:
            return found
    return None


def match_direct(batch: Any, sharded: dict[str, nn.Module]) -> tuple[dict[str, CallArgs], dict[str, str]]:
    """Match each sharded module to a KJT of `batch`.

    Returns:
        `(found, rejected)`: CallArgs for the matched modules, a reason for the others.
    """
    kjts = find_kjts(batch)
    found: dict[str, CallArgs] = {}
    rejected: dict[str, str] = {}
    for fqn, module in sharded.items():
        info, why = _match_one(kjts, expected_features(module))
        if info is None:
            rejected[fqn] = why
        else:
            found[fqn] = CallArgs(args=(info,))
    return found, rejected


def _match_one(kjts: list, features: list[str] | None) -> tuple[ArgInfo | None, str]:
    if not kjts:
        return None, "direct lookup found no KeyedJaggedTensor in the batch"
    if features is None:
        if len(kjts) == 1:
            return kjts[0][0], ""
        return None, "direct lookup: feature names unknown and the batch holds several KJTs"
    want = set(features)
    exact = _distinct([(i, k) for i, k in kjts if set(k.keys()) == want])
    superset = _distinct([(i, k) for i, k in kjts if want <= set(k.keys())])
    for candidates in (exact, superset):
        if len(candidates) == 1:
            return candidates[0][0], ""
        if len(candidates) > 1:
            paths = ", ".join(str(i) for i, _ in candidates)
            return None, f"direct lookup is ambiguous: {paths} all hold its features; give a path"
    return None, f"direct lookup found no KJT with features {sorted(want)}"


def _distinct(pairs: list) -> list:
    seen: set[int] = set()
    return [(i, k) for i, k in pairs if not (id(k) in seen or seen.add(id(k)))]
