"""Programs over the batch (rewrite/): the split, built and shared patterns, found by the fx trace and
by recording the first forward, replayed on another batch; rejections with their source line; call
sites and call counts; explicit input functions.

One process, no process group: `FakeSharded` (tests/test_rewrite.py) is a ShardedModule whose
input_dist passes its KJT through and whose compute sums each feature's ids. The replayed inputs are
compared with what the model's own forward passes (a forward pre-hook on the unrewritten model).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn
from torchrec import JaggedTensor, KeyedJaggedTensor

from rewrite import (
    CallCountError,
    ContextSlot,
    PathError,
    RewriteError,
    outermost_sharded,
    rewrite_model,
    site_key,
)
from rewrite.torchrec_args import ArgInfo as TorchrecArgInfo
from rewrite.torchrec_args import ArgInfoStepFactory, CallArgs
from tests.test_rewrite import FakeSharded


@dataclass
class Batch:
    sparse: KeyedJaggedTensor  # features x, y, z
    history: KeyedJaggedTensor  # feature h
    candidates: KeyedJaggedTensor  # feature h
    ids: torch.Tensor
    lengths: torch.Tensor
    offsets: torch.Tensor
    weights: torch.Tensor
    dense: torch.Tensor


def _kjt(keys: list[str], gen: torch.Generator) -> KeyedJaggedTensor:
    lengths = torch.randint(0, 4, (2 * len(keys),), generator=gen)
    values = torch.randint(0, 10, (int(lengths.sum()),), generator=gen)
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)


def make_batch(seed: int) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 4, (2,), generator=gen)
    n = int(lengths.sum())
    return Batch(
        sparse=_kjt(["x", "y", "z"], gen),
        history=_kjt(["h"], gen),
        candidates=_kjt(["h"], gen),
        ids=torch.randint(0, 10, (n,), generator=gen),
        lengths=lengths,
        offsets=torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        weights=torch.rand(n, generator=gen),
        dense=torch.rand(2, 3, generator=gen),
    )


SPLIT = "batch.sparse.split([2, 1])"
SELECT = "KeyedJaggedTensor.from_jt_dict({'x': batch.sparse['x'], 'z': batch.sparse['z']})"
TO_DICT = "{'y': batch.sparse.to_dict()['y'], 'x': batch.sparse.to_dict()['x']}"
PATTERNS = {  # pattern: (features of each sharded module, the program of each call site)
    "split": ({"a": ["x", "y"], "b": ["z"]}, {"a": f"{SPLIT}[0]", "b": f"{SPLIT}[1]"}),
    "permute": ({"a": ["z", "x", "y"]}, {"a": "batch.sparse.permute([2, 0, 1])"}),
    "select": ({"a": ["x", "z"]}, {"a": SELECT}),
    "to_dict": ({"a": ["y", "x"]}, {"a": f"KeyedJaggedTensor.from_jt_dict({TO_DICT})"}),
    "constructor": (
        {"c": ["w"]},
        {"c": "KeyedJaggedTensor(keys=['w'], values=batch.ids, lengths=batch.lengths)"},
    ),
    "from_lengths": (
        {"c": ["w"]},
        {
            "c": "KeyedJaggedTensor.from_lengths_sync(keys=['w'], values=batch.ids, lengths=batch.lengths, "
            "weights=batch.weights)"
        },
    ),
    "from_offsets": (
        {"c": ["w"]},
        {"c": "KeyedJaggedTensor.from_offsets_sync(keys=['w'], values=batch.ids, offsets=batch.offsets)"},
    ),
    "jt_dict": (
        {"c": ["w"]},
        {"c": "KeyedJaggedTensor.from_jt_dict({'w': JaggedTensor(values=batch.ids, lengths=batch.lengths)})"},
    ),
    "shared": ({"s": ["h"]}, {"s": "batch.history", "s@1": "batch.candidates"}),
    "shared_mixed": (
        {"s": ["h"]},
        {
            "s": "batch.history",
            "s@1": "KeyedJaggedTensor.from_lengths_sync(keys=['h'], values=batch.ids, lengths=batch.lengths)",
        },
    ),
}


class Patterns(nn.Module):
    """Feeds its sharded modules by one pattern; `untraceable` adds data-dependent control flow."""

    def __init__(self, pattern: str, untraceable: bool = False) -> None:
        super().__init__()
        self.pattern, self.untraceable = pattern, untraceable
        for fqn, features in PATTERNS[pattern][0].items():
            setattr(self, fqn, FakeSharded(features))

    def forward(self, batch: Batch) -> torch.Tensor:
        if self.untraceable and batch.dense.sum() > -1:  # always true; fx cannot trace it
            pass
        outs = [module(features) for module, features in self.calls(batch)]
        return sum((i + 1) * out.sum() for i, out in enumerate(outs))  # call order matters

    def calls(self, batch: Batch) -> list:
        p, sparse = self.pattern, batch.sparse
        if p == "split":
            parts = sparse.split([2, 1])
            return [(self.a, parts[0]), (self.b, parts[1])]
        if p == "permute":
            return [(self.a, sparse.permute([2, 0, 1]))]
        if p == "select":
            return [(self.a, KeyedJaggedTensor.from_jt_dict({k: sparse[k] for k in ("x", "z")}))]
        if p == "to_dict":
            d = sparse.to_dict()
            return [(self.a, KeyedJaggedTensor.from_jt_dict({"y": d["y"], "x": d["x"]}))]
        if p == "constructor":
            return [(self.c, KeyedJaggedTensor(keys=["w"], values=batch.ids, lengths=batch.lengths))]
        if p == "from_lengths":
            kjt = KeyedJaggedTensor.from_lengths_sync(
                keys=["w"], values=batch.ids, lengths=batch.lengths, weights=batch.weights
            )
            return [(self.c, kjt)]
        if p == "from_offsets":
            return [
                (
                    self.c,
                    KeyedJaggedTensor.from_offsets_sync(keys=["w"], values=batch.ids, offsets=batch.offsets),
                )
            ]
        if p == "jt_dict":
            jt = JaggedTensor(values=batch.ids, lengths=batch.lengths)
            return [(self.c, KeyedJaggedTensor.from_jt_dict({"w": jt}))]
        if p == "shared":
            return [(self.s, batch.history), (self.s, batch.candidates)]
        built = KeyedJaggedTensor.from_lengths_sync(keys=["h"], values=batch.ids, lengths=batch.lengths)
        return [(self.s, batch.history), (self.s, built)]


def real_inputs(model: nn.Module, batch: Batch) -> dict[str, tuple]:
    """What the model's forward passes to each sharded call, by call site key."""
    seen, counts, handles = {}, Counter(), []
    for fqn, module in outermost_sharded(model).items():

        def hook(mod, args, kwargs, fqn=fqn):
            seen[site_key(fqn, counts[fqn])] = (tuple(args), kwargs)
            counts[fqn] += 1

        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        model(batch)
    finally:
        for h in handles:
            h.remove()
    return seen


def assert_same_kjt(replayed, real, scenario: str) -> None:
    assert isinstance(replayed, KeyedJaggedTensor), scenario
    assert replayed.keys() == real.keys(), scenario
    assert torch.equal(replayed.lengths(), real.lengths()), scenario
    assert torch.equal(replayed.values(), real.values()), scenario
    rw, gw = replayed.weights_or_none(), real.weights_or_none()
    assert (rw is None and gw is None) or torch.equal(rw, gw), scenario


def assert_replay_matches_forward(model, rw, batch, scenario: str) -> None:
    replayed = {site.key: (args, kwargs) for site, args, kwargs in rw.site_inputs(batch, {})}
    rw.restore()
    real = real_inputs(model, batch)
    assert sorted(replayed) == sorted(real), scenario
    for key, (args, kwargs) in replayed.items():
        assert len(args) == len(real[key][0]) == 1 and not kwargs, f"{scenario} {key}"
        assert_same_kjt(args[0], real[key][0][0], f"{scenario} {key}")


class Ctx:
    """A ForwardContext holding each call site's input_dist result (as the pipeline would)."""

    def __init__(self, rw, batch) -> None:
        self.prepared = {
            site.key: (None, site.module.input_dist(None, *args, **kwargs).wait().wait())
            for site, args, kwargs in rw.site_inputs(batch, {})
        }

    def take_input_dist(self, key):
        return self.prepared.pop(key, None)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_trace_finds_the_program_and_its_replay_is_what_forward_passes(pattern):
    model, b0, b1 = Patterns(pattern), make_batch(0), make_batch(1)
    expected = model(b1)
    slot = ContextSlot()
    rw = rewrite_model(model, b0, slot=slot, record=True, strict=True)
    assert not rw.needs_recording, pattern
    assert {s.key: s.program for s in rw.report.sites} == PATTERNS[pattern][1], pattern
    assert {m.method for m in rw.report.modules} == {"traced"}, pattern
    for key, program in PATTERNS[pattern][1].items():
        assert any(
            line.split()[:3] == [key, "yes", "traced"] and program in line
            for line in str(rw.report).splitlines()
        ), key
    slot.current = Ctx(rw, b1)  # the hijacked forwards take each call site's input
    assert torch.equal(model(b1), expected), pattern
    slot.check_calls()
    slot.current = None
    assert_replay_matches_forward(model, rw, b1, pattern)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_recording_finds_the_same_programs_where_the_trace_fails(pattern):
    model, b0, b1 = Patterns(pattern, untraceable=True), make_batch(0), make_batch(1)
    plain = model(b0)
    rw = rewrite_model(model, b0, slot=ContextSlot(), record=True)
    assert rw.needs_recording and rw.modules == [] and "TraceError" in rw.report.trace_error, pattern
    with rw.record(b0):
        out = model(b0)  # the first forward runs unpipelined
    assert torch.equal(out, plain), pattern
    assert {s.key: s.program for s in rw.report.sites} == PATTERNS[pattern][1], pattern
    assert {m.method for m in rw.report.modules} == {"recorded"}, pattern
    assert rw.signature().splitlines() == [f"{k}: {p}" for k, p in PATTERNS[pattern][1].items()], pattern
    assert_replay_matches_forward(model, rw, b1, pattern)
    # negative twin: without the recording, the programs are not found
    rw = rewrite_model(model, b0, slot=ContextSlot())
    assert {s.key: s.program for s in rw.report.sites} != PATTERNS[pattern][1], pattern


def test_shared_program_is_computed_once_and_replay_writes_nothing_into_the_batch(monkeypatch):
    model, b0, b1 = Patterns("split"), make_batch(0), make_batch(1)
    rw = rewrite_model(model, b0, slot=ContextSlot())
    a, b = (site.args.args[0] for site in rw.sites)
    assert a.source is b.source, "both sites continue from one split program"
    calls = []
    original = KeyedJaggedTensor.split
    monkeypatch.setattr(KeyedJaggedTensor, "split", lambda self, s: calls.append(s) or original(self, s))
    list(rw.site_inputs(b1, {}))
    assert calls == [[2, 1]], "split once per batch for two call sites"
    model, b1 = Patterns("to_dict"), make_batch(1)
    rw = rewrite_model(model, b0, slot=ContextSlot())
    list(rw.site_inputs(b1, {}))
    assert b1.sparse._jt_dict is None, "to_dict replayed on a copy: the batch's KJT keeps no cache"


HERE = Path(__file__)


def line_of(marker: str) -> str:
    number = next(
        i for i, text in enumerate(HERE.read_text().splitlines(), 1) if text.endswith(f"# {marker}")
    )
    return f"{HERE.name}:{number}"


class Rejected(nn.Module):
    def __init__(self, how: str, untraceable: bool = False) -> None:
        super().__init__()
        self.how, self.untraceable = how, untraceable
        self.c = FakeSharded(["w"])
        self.ids = nn.Parameter(torch.arange(4), requires_grad=False)
        self.lin = nn.Linear(3, 2)

    def forward(self, batch: Batch) -> torch.Tensor:
        if self.untraceable and batch.dense.sum() > -1:
            pass
        n, make = batch.lengths, KeyedJaggedTensor
        if self.how == "parameter":
            kjt = make(keys=["w"], values=self.ids, lengths=torch.tensor([1, 3]))  # parameter
        elif self.how == "max":
            kjt = make(keys=["w"], values=batch.ids % batch.ids.max(), lengths=n)  # max
        else:
            kjt = make(keys=["w"], values=self.lin(batch.dense).flatten().long(), lengths=n)  # output
        return self.c(kjt).sum()


@pytest.mark.parametrize(
    ("how", "traced", "recorded"),
    [
        ("parameter", "model attribute 'ids'", "parameter 'ids' of the model"),
        ("max", "call_method 'max'", "computed from batch.ids by max"),
        ("output", "module 'lin', which has trainable parameters", "computed from batch.dense by linear"),
    ],
)
def test_rejections_name_the_reason_and_the_source_line(how, traced, recorded):
    b0 = make_batch(0)
    b0.lengths = torch.tensor([1, 3])  # four values in every variant
    rw = rewrite_model(Rejected(how), b0, slot=ContextSlot(), record=True)
    (module,) = rw.report.not_pipelined
    assert traced in module.reason and module.reason.endswith(f"{line_of(how)})"), how
    with pytest.raises(RewriteError, match=traced.split("'")[0]):  # at once: no recording changes it
        rewrite_model(Rejected(how), b0, slot=ContextSlot(), strict=True, record=True)
    model = Rejected(how, untraceable=True)
    rw = rewrite_model(model, b0, slot=ContextSlot(), record=True, strict=True)
    with pytest.raises(RewriteError, match="cannot be pipelined"), rw.record(b0):
        model(b0)
    (module,) = rw.report.not_pipelined
    assert recorded in module.reason and line_of(how) in module.reason, how
    assert "forward" not in vars(model.c), how


class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.s = FakeSharded(["h"])
        self.n = 2

    def forward(self, batch: Batch) -> torch.Tensor:
        return sum(self.s(kjt).sum() for kjt in [batch.history, batch.candidates, batch.history][: self.n])


def test_a_changed_call_count_raises_instead_of_returning_a_wrong_result():
    model, b0 = Shared(), make_batch(0)
    slot = ContextSlot()
    rw = rewrite_model(model, b0, slot=slot)
    assert [s.key for s in rw.sites] == ["s", "s@1"]
    model.n = 1
    slot.current = Ctx(rw, b0)
    model(b0)
    with pytest.raises(CallCountError, match=r"'s': 1 call\(s\) for 2 call site\(s\)"):
        slot.check_calls()
    model.n = 3
    slot.current = Ctx(rw, b0)
    with pytest.raises(CallCountError, match=r"'s'.*call number 3.*2 call site\(s\)"):
        model(b0)
    model.n = 2  # the same context again: its inputs were taken
    slot.current = Ctx(rw, b0)
    model(b0)
    slot.check_calls()


def test_explicit_functions_are_checked_against_the_recorded_forward():
    model, b0, b1 = Shared(), make_batch(0), make_batch(1)
    with pytest.raises(ValueError, match="record=True"):
        rewrite_model(model, b0, slot=ContextSlot(), paths={"s": lambda b: [b.history, b.candidates]})
    rw = rewrite_model(
        model, b0, slot=ContextSlot(), record=True, paths={"s": lambda b: [b.history, ((b.candidates,), {})]}
    )
    assert rw.needs_recording and rw.modules == []
    with rw.record(b0):
        model(b0)
    assert [(m.fqn, m.method) for m in rw.report.modules] == [("s", "explicit")]
    assert [s.program for s in rw.report.sites] == ["<lambda>(batch)[0]", "<lambda>(batch)[1]"]
    assert_replay_matches_forward(model, rw, b1, "explicit")
    rw = rewrite_model(
        model, b0, slot=ContextSlot(), record=True, paths={"s": lambda b: [b.candidates, b.history]}
    )
    with (
        pytest.raises(
            PathError,
            match=r"'s' differs .*call site s: arguments\[0\]: (lengths|values) differ \(.* replayed\)",
        ),
        rw.record(b0),
    ):
        model(b0)
    assert "forward" not in vars(model.s)


class Raises(Patterns):
    def forward(self, batch: Batch) -> torch.Tensor:
        self.calls(batch)
        raise RuntimeError("forward failed")


def test_recording_undoes_every_patch_when_forward_raises():
    model, b0 = Raises("split", untraceable=True), make_batch(0)
    before = {
        name: vars(KeyedJaggedTensor)[name]
        for name in ("split", "__init__", "__getitem__", "from_lengths_sync")
    }
    rw = rewrite_model(model, b0, slot=ContextSlot(), record=True, method="record")
    with pytest.raises(RuntimeError, match="forward failed"), rw.record(b0):
        model(b0)
    assert {name: vars(KeyedJaggedTensor)[name] for name in before} == before
    assert not (model.a._forward_pre_hooks or model.a._forward_hooks)
    assert torch._C._len_torch_function_stack() == 0
    assert rw.needs_recording, "the rewrite stays pending"
    with rw.record(b0):
        Patterns.forward(model, b0)
    assert rw.report.pipelined == ["a", "b"]


def test_torchrec_arginfo_api_still_builds_call_args():
    b0 = make_batch(0)
    steps = ArgInfoStepFactory
    args = CallArgs(
        [TorchrecArgInfo([steps.noop(), steps.get_attr("history")])],
        {"n": TorchrecArgInfo([steps.from_scalar(3)])},
    )
    built_args, built_kwargs = args.build_args_kwargs(b0)
    assert built_args == [b0.history] and built_kwargs == {"n": 3}
