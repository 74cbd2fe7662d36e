"""The copy stage moves every tensor of a batch of any shape (one process; the "meta" device stands
in for a GPU: `.to("meta")` makes a new tensor, so a batch left where it was shows)."""

from __future__ import annotations

import dataclasses
from collections import namedtuple

import torch

from pipeline.pipelines.core import to_device

META = torch.device("meta")
Pair = namedtuple("Pair", ["ids", "dense"])


@dataclasses.dataclass
class Nested:
    pair: Pair
    extra: dict


def test_a_namedtuple_batch_is_moved_field_by_field_and_keeps_its_type():
    moved = to_device(Pair(torch.arange(3), torch.ones(2)), META, non_blocking=False)
    assert type(moved) is Pair, f"a namedtuple came back as {type(moved).__name__}"
    assert moved.ids.device == META and moved.dense.device == META, "namedtuple fields were not moved"


def test_containers_of_every_kind_are_moved():
    batch = Nested(pair=Pair(torch.arange(3), [torch.ones(1), (torch.zeros(1),)]), extra={"x": torch.ones(1)})
    moved = to_device(batch, META, non_blocking=False)
    assert moved.pair.ids.device == META, "namedtuple inside a dataclass"
    assert moved.pair.dense[0].device == META and moved.pair.dense[1][0].device == META, "list / tuple"
    assert moved.extra["x"].device == META, "dict"
    assert batch.pair.ids.device.type == "cpu", "the caller's batch was changed"
