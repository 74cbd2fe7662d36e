"""The per-batch replay of a settled rewrite (rewrite/replay.py): what it decides once, and what it
leaves for each batch.

- a call site whose arguments are paths from the batch is read along `ArgInfo.read`, made once: the
  replay of such sites enters no module of rewrite/ but replay.py (its twin, with the readers
  off, replays the programs through rewrite/arginfo.py);
- `ArgInfo.read` is `resolve(batch)`, an attribute chain being one `operator.attrgetter`;
- the splits fusion is decided once (`fused`) and undone by `restore`.

One process, no process group (`FakeSharded`, as in tests/test_rewrite_programs.py).
"""

from __future__ import annotations

import operator
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torchrec import JaggedTensor, KeyedJaggedTensor

from rewrite import ArgInfo, Attr, Call, Const, ContextSlot, parse_path, rewrite_model
from rewrite import replay as replay_module
from tests.test_rewrite import FakeSharded
from tests.test_rewrite_programs import Patterns, make_batch

REWRITE = Path(replay_module.__file__).parent


def entered(fn) -> set[str]:
    """The files of rewrite/ whose functions `fn()` enters."""
    files: set[str] = set()

    def seen(frame, event, arg):
        if event == "call" and Path(frame.f_code.co_filename).parent == REWRITE:
            files.add(Path(frame.f_code.co_filename).name)

    sys.setprofile(seen)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return files


def test_paths_are_read_along_readers_made_once(monkeypatch):
    b0, b1 = make_batch(0), make_batch(1)
    rw = rewrite_model(Patterns("shared"), b0, slot=ContextSlot())
    assert [str(s.args) for s in rw.sites] == ["batch.history", "batch.candidates"]
    inputs = []
    assert entered(lambda: inputs.extend(rw.site_inputs(b1, {}))) == {"replay.py"}
    assert [(site.key, args, kwargs) for site, args, kwargs in inputs] == [
        ("s", [b1.history], {}),
        ("s@1", [b1.candidates], {}),
    ]
    assert inputs[0][1][0] is b1.history, "the batch's own KJT, as forward receives it"
    # twin: with every site built from its program per batch, the replay enters arginfo.py
    monkeypatch.setattr(replay_module._SiteReader, "of", classmethod(lambda cls, site: cls(site, None)))
    rw = rewrite_model(Patterns("shared"), b0, slot=ContextSlot())
    assert "arginfo.py" in entered(lambda: list(rw.site_inputs(b1, {})))


def test_programs_beyond_paths_are_still_built_per_batch():
    b0, b1 = make_batch(0), make_batch(1)
    rw = rewrite_model(Patterns("shared_mixed"), b0, slot=ContextSlot())
    (history, _), (built, _) = ((args, kwargs) for _, args, kwargs in rw.site_inputs(b1, {}))
    assert history == [b1.history]
    assert torch.equal(built[0].values(), b1.ids) and torch.equal(built[0].lengths(), b1.lengths)


class Holder:
    def __init__(self, batch) -> None:
        self.inner = batch
        self.by_name = {"h": batch.history}


def same(a, b) -> bool:
    if isinstance(a, (KeyedJaggedTensor, JaggedTensor)):  # computed anew by each replay
        return (
            type(a) is type(b)
            and torch.equal(a.values(), b.values())
            and torch.equal(a.lengths(), b.lengths())
        )
    return a is b or a == b


@pytest.mark.parametrize(
    "info",
    [
        parse_path("inner.history"),
        parse_path("inner.ids"),
        parse_path("by_name['h']"),
        parse_path("inner.sparse['x']"),
        ArgInfo((Const(7),)),
        ArgInfo(),
        ArgInfo((Attr("inner"), Attr("sparse"), Call("permute", ([2, 0, 1],)))),
    ],
    ids=str,
)
def test_read_is_resolve(info):
    batch = Holder(make_batch(0))
    assert same(info.read(batch), info.resolve(batch))
    assert same(info.read(batch), info.resolve(batch))  # and stays so: nothing cached on the program
    assert batch.inner.sparse._index_per_key is None, "read, like resolve, writes nothing into the batch"


def test_an_attribute_chain_reads_in_one_attrgetter():
    assert isinstance(parse_path("inner.history").read, operator.attrgetter)
    assert not isinstance(parse_path("by_name['h']").read, operator.attrgetter)


class Lazy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.s = FakeSharded(["h"])
        self.s._has_uninitialized_input_dist = True  # as torchrec's before the first input

    def forward(self, batch):
        return self.s(batch.history).sum()


def test_splits_fuse_once_the_input_dists_exist_and_restore_unfuses():
    model = Lazy()
    rw = rewrite_model(model, make_batch(0), slot=ContextSlot())
    assert not rw.fuse_splits() and not rw.fused, "no input dist yet: nothing to fuse"
    model.s._has_uninitialized_input_dist = False
    assert rw.fuse_splits() and rw.fused
    rw.restore()
    assert not rw.fused
