"""The status row on the fused splits all-to-all (pipeline.ranks.riding), driven with fake awaitables
and a fake process group: what StatusSplits and StatusOnly send and read back, and when
`riding_fits` says statuses must not ride (a torchrec whose private fields changed, an input dist
that may issue a collective of its own)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from torch import nn
from torchrec.distributed.embedding_sharding import FusedKJTListSplitsAwaitable, KJTSplitsAllToAllMeta
from torchrec.distributed.sharding.tw_sharding import TwSparseFeaturesDist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from pipeline.ranks import riding as rows_module
from pipeline.ranks.riding import StatusOnly, StatusSplits, pack, riding_fits, splits_shape, unpack

WORLD = 2


class _PG:
    def size(self) -> int:
        return WORLD

    def rank(self) -> int:
        return 0


class _Collective:
    """Stands in for torchrec's SplitsAllToAllAwaitable: every rank sent what this one sends, so
    row i reads back as [row i of rank 0, row i of rank 1]."""

    sent: list[list[torch.Tensor]] = []

    def __init__(self, input_tensors, pg, *args, **kwargs) -> None:
        self.input_tensors = list(input_tensors)
        _Collective.sent.append(self.input_tensors)

    def wait(self) -> list[list[int]]:
        return [t.tolist() for t in self.input_tensors]


@dataclass
class _Request:
    awaitables: list
    _module_fqn: str = "ebc"
    _sharding_types: list = field(default_factory=list)


def _meta(n_tensors: int) -> KJTSplitsAllToAllMeta:
    kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([1, 2]), torch.tensor([1, 1]))
    return KJTSplitsAllToAllMeta(
        pg=_PG(),
        _input=kjt,
        splits=[1, 0],
        splits_tensors=[torch.tensor([3, 4]) for _ in range(n_tensors)],
        input_splits=[],
        input_tensors=[],
        labels=[],
        keys=["f"],
        device=torch.device("cpu"),
        stagger=1,
    )


@pytest.fixture
def collective(monkeypatch):
    _Collective.sent = []
    monkeypatch.setattr("torchrec.distributed.embedding_sharding.SplitsAllToAllAwaitable", _Collective)
    monkeypatch.setattr(rows_module, "SplitsAllToAllAwaitable", _Collective)
    return _Collective


def test_status_splits_sends_the_word_after_the_splits_and_reads_every_ranks(collective):
    metas = [_meta(2), _meta(3)]
    requests = [_Request([metas[0]]), _Request([metas[1]])]
    carried = StatusSplits(requests, [None, None], _PG(), word=lambda rows: pack(1, rows, 7))
    sent = collective.sent[-1]
    assert carried.rows == 5 and len(sent) == 6, "the word is one more row after the 5 splits rows"
    assert [unpack(w).rows for w in carried.words()] == [5, 5]
    assert [unpack(w).observation for w in carried.words()] == [7, 7]
    assert len(metas[1].splits_tensors) == 3, "the last module's splits are left as they were"
    assert sum(carried._lengths) == 5, "the word is left out when the splits are read"
    shape = splits_shape([(["ebc"], carried)])
    assert shape is not None and [(rows, carries) for _, rows, _, carries in shape] == [(5, True)]


def test_status_only_sends_zero_splits_of_the_shape_and_the_word(collective):
    only = StatusOnly(_PG(), 5, pack(0, 5), torch.device("cpu"))
    sent = collective.sent[-1]
    assert len(sent) == 6 and all(t.tolist() == [0, 0] for t in sent[:5])
    assert [unpack(w).rows for w in only.words()] == [5, 5] and only.carries
    with pytest.raises(RuntimeError, match="no batch to distribute"):
        only.wait()


def test_a_torchrec_whose_fused_awaitable_changed_its_fields_is_refused(monkeypatch):
    class Changed(FusedKJTListSplitsAwaitable):
        def __init__(self, requests, contexts, pg) -> None:  # sets none of the fields used
            self._requests = requests

    assert riding_fits([]) is None  # the installed torchrec: fits
    monkeypatch.setattr(rows_module, "FusedKJTListSplitsAwaitable", Changed)
    why = riding_fits([])
    assert why is not None and "_awaitables, _lengths, _splits_awaitable" in why


class _Sharded(nn.Module):
    def __init__(self, input_dist: nn.Module) -> None:
        super().__init__()
        self._input_dists = nn.ModuleList([input_dist])


def test_an_input_dist_that_may_issue_another_collective_is_refused():
    class Gathers(nn.Module):  # e.g. an input dist that all_gathers its batch sizes first
        def forward(self, kjt):
            return kjt

    known = _Sharded(TwSparseFeaturesDist(_PG(), [2, 1]))
    assert riding_fits([known]) is None  # the twin: torchrec's table-wise input dist fits
    why = riding_fits([known, _Sharded(Gathers())])
    assert why is not None and "Gathers may issue collectives of its own" in why


def test_a_kjt_all_to_all_without_a_field_used_is_refused():
    module = _Sharded(TwSparseFeaturesDist(_PG(), [2, 1]))
    del module._input_dists[0]._dist._stagger  # a torchrec that renamed it
    why = riding_fits([module])
    assert why is not None and "_stagger" in why
