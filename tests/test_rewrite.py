"""rewrite/ on small single-process models: ArgInfo shapes, the three finding methods, fallback,
rejected patterns, strict mode and exact restore.

`FakeSharded` is a ShardedModule whose "input_dist" is a no-op and whose compute is a pooled sum, so
the rewrite can be exercised without process groups; the 2-rank test with real all-to-alls is in
test_rewrite_dist.py.
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.types import ShardedModule

from rewrite import (
    ArgInfo,
    Attr,
    ContextSlot,
    Item,
    NotPreparedError,
    PathError,
    PipelinedForward,
    RewriteError,
    find_kjts,
    parse_path,
    rewrite_model,
)


class _Ready:
    def __init__(self, value):
        self.value = value

    def wait(self):
        return self.value


class FakeSharded(ShardedModule):
    """input_dist passes the KJT through; compute sums each bag of ids as floats."""

    def __init__(self, features: list[str]) -> None:
        super().__init__()
        self._embedding_bag_configs = [
            EmbeddingBagConfig(name=f"t_{f}", embedding_dim=2, num_embeddings=10, feature_names=[f])
            for f in features
        ]
        self.scale = nn.Parameter(torch.ones(()))

    def create_context(self):
        return None

    def input_dist(self, ctx, features):
        return _Ready(_Ready(features))

    def compute(self, ctx, dist_input):
        return torch.stack([self.scale * dist_input[k].values().float().sum() for k in dist_input.keys()])

    def output_dist(self, ctx, output):
        return output

    @property
    def unsharded_module_type(self):
        return nn.Module


def kjt(keys: list[str], seed: int = 0) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 3, (2 * len(keys),), generator=g)
    values = torch.randint(0, 10, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)


@dataclass
class Inner:
    kjt: KeyedJaggedTensor


@dataclass
class Outer:
    dense: torch.Tensor
    inner: Inner
    by_name: dict


class Model(nn.Module):
    """Reads `batch.inner.kjt` for `a` and `batch.by_name["u"]` for `b`."""

    def __init__(self) -> None:
        super().__init__()
        self.a = FakeSharded(["x"])
        self.b = FakeSharded(["u"])
        self.lin = nn.Linear(3, 1)

    def forward(self, batch):
        return self.lin(batch.dense).sum() + self.a(batch.inner.kjt).sum() + self.b(batch.by_name["u"]).sum()


def outer_batch(seed: int = 0) -> Outer:
    return Outer(dense=torch.ones(2, 3), inner=Inner(kjt(["x"], seed)), by_name={"u": kjt(["u"], seed + 1)})


class Ctx:
    """A ForwardContext that runs postprocs and input_dist the way a pipeline would (here:
    synchronously)."""

    def __init__(self, rewrite, batch) -> None:
        self.prepared = {}
        self.postproc_results = {}
        for pm in rewrite.modules:
            args, kwargs = pm.args.build(
                batch, lambda c, b: rewrite.run_postproc(c, b, self.postproc_results)
            )
            self.prepared[pm.fqn] = (None, pm.module.input_dist(None, *args, **kwargs).wait().wait())

    def take_input_dist(self, fqn):
        return self.prepared.pop(fqn, None)

    def take_prefetched(self, fqn):
        return self.prepared.pop(fqn, None)

    def postproc_result(self, fqn):
        return self.postproc_results.get(fqn)


def run_pipelined(model, rewrite, slot, batch):
    slot.current = Ctx(rewrite, batch)
    try:
        return model(batch)
    finally:
        slot.current = None


# -- ArgInfo ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "steps"),
    [
        ("sparse_features", (Attr("sparse_features"),)),
        ("batch.a.b", (Attr("a"), Attr("b"))),
        ('features["user"]', (Attr("features"), Item("user"))),
        ("[0]", (Item(0),)),
        ("item_features['kjt']", (Attr("item_features"), Item("kjt"))),
        ("[1].x[-1]", (Item(1), Attr("x"), Item(-1))),
    ],
)
def test_parse_path(text, steps):
    assert parse_path(text).steps == steps


@pytest.mark.parametrize("text", ["", "a..b", "a b", "a[", "a['x]", "a.1"])
def test_parse_path_rejects_malformed(text):
    with pytest.raises(PathError, match="path"):
        parse_path(text)


def test_arginfo_resolves_every_shape():
    k = kjt(["x"])
    assert parse_path("[0]").resolve([k]) is k
    assert parse_path("['kjt']").resolve({"kjt": k}) is k
    assert parse_path("inner.kjt").resolve(Outer(torch.ones(1), Inner(k), {})) is k
    assert parse_path("by_name['u'][1]").resolve(Outer(torch.ones(1), Inner(k), {"u": [0, k]})) is k
    from rewrite import Const

    assert ArgInfo((Const(7),)).resolve(object()) == 7


def test_find_kjts_walks_dataclasses_dicts_lists():
    batch = outer_batch()
    found = {str(info): value for info, value in find_kjts(batch)}
    assert found == {"batch.inner.kjt": batch.inner.kjt, "batch.by_name['u']": batch.by_name["u"]}
    assert [str(i) for i, _ in find_kjts([{"a": kjt(["x"])}, (kjt(["y"]),)])] == [
        "batch[0]['a']",
        "batch[1][0]",
    ]


# -- the three methods --------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "how"), [("auto", "traced"), ("trace", "traced"), ("direct", "direct")])
def test_methods_find_paths_and_outputs_match(method, how):
    model, batch = Model(), outer_batch()
    expected = model(batch)
    slot = ContextSlot()
    rw = rewrite_model(model, batch, slot=slot, method=method)
    paths = {m.fqn: (m.method, m.path) for m in rw.report.modules}
    assert paths == {"a": (how, "batch.inner.kjt"), "b": (how, "batch.by_name['u']")}
    assert isinstance(model.a.forward, PipelinedForward)
    assert torch.equal(run_pipelined(model, rw, slot, batch), expected)


def test_explicit_paths_take_precedence_and_are_validated():
    model, batch = Model(), outer_batch()
    slot = ContextSlot()
    rw = rewrite_model(model, batch, slot=slot, paths={"a": "inner.kjt"})
    assert {m.fqn: m.method for m in rw.report.modules} == {"a": "explicit", "b": "traced"}
    rw.restore()
    with pytest.raises(PathError, match="not a sharded module"):
        rewrite_model(model, batch, slot=slot, paths={"nope": "inner.kjt"})
    with pytest.raises(PathError, match="does not resolve"):
        rewrite_model(model, batch, slot=slot, paths={"a": "inner.missing"})
    with pytest.raises(PathError, match="not a KeyedJaggedTensor"):
        rewrite_model(model, batch, slot=slot, paths={"a": "dense"})
    assert "forward" not in vars(model.a)  # failed rewrites left nothing behind


def test_explicit_only_leaves_the_rest_unpipelined():
    model, batch = Model(), outer_batch()
    rw = rewrite_model(model, batch, slot=ContextSlot(), method="explicit", paths={"a": "inner.kjt"})
    assert rw.report.pipelined == ["a"]
    assert "no explicit path" in rw.report.not_pipelined[0].reason


def test_explicit_path_may_be_a_torchrec_style_arginfo():
    from rewrite.torchrec_args import ArgInfo as TorchrecArgInfo
    from rewrite.torchrec_args import ArgInfoStepFactory as steps

    model, batch = Model(), outer_batch()
    info = TorchrecArgInfo([steps.noop(), steps.get_attr("inner"), steps.get_attr("kjt")])
    rw = rewrite_model(model, batch, slot=ContextSlot(), method="explicit", paths={"a": info})
    assert rw.report.pipelined == ["a"]
    assert [m.path for m in rw.report.modules if m.fqn == "a"] == ["batch.inner.kjt"]
    rw.restore()
    with pytest.raises(PathError, match="not a path"):
        rewrite_model(model, batch, slot=ContextSlot(), paths={"a": TorchrecArgInfo([steps.from_scalar(1)])})


class Untraceable(Model):
    def forward(self, batch):
        if batch.dense.sum() > 0:  # data-dependent control flow: fx cannot trace this
            return self.a(batch.inner.kjt).sum() + self.b(batch.by_name["u"]).sum()
        return batch.dense.sum()


def test_untraceable_model_falls_back_to_direct():
    model, batch = Untraceable(), outer_batch()
    expected = model(batch)
    slot = ContextSlot()
    rw = rewrite_model(model, batch, slot=slot)
    assert rw.report.trace_error and "TraceError" in rw.report.trace_error
    assert {m.fqn: m.method for m in rw.report.modules} == {"a": "direct", "b": "direct"}
    assert "direct lookup used" in str(rw.report)
    assert torch.equal(run_pipelined(model, rw, slot, batch), expected)


def test_direct_ignores_unrelated_kjts_and_reports_ambiguity():
    batch = {"labels": kjt(["label"]), "one": kjt(["x"]), "two": kjt(["x"], 3), "u": kjt(["u"])}
    rw = rewrite_model(Model(), batch, slot=ContextSlot(), method="direct")
    by_fqn = {m.fqn: m for m in rw.report.modules}
    assert by_fqn["b"].pipelined and by_fqn["b"].path == "batch['u']"
    assert not by_fqn["a"].pipelined and "ambiguous" in by_fqn["a"].reason


# -- patterns that cannot be pipelined ----------------------------------------------------------


class FromValuesMax(Model):
    def forward(self, batch):
        features = batch.inner.kjt
        ids = features.values() % features.values().max()  # a value computed from batch data
        rebuilt = KeyedJaggedTensor(keys=features.keys(), values=ids, lengths=features.lengths())
        return self.a(rebuilt).sum() + self.b(batch.by_name["u"]).sum()


class TrainableInput(Model):
    def __init__(self) -> None:
        super().__init__()
        self.make = MakeKJT(trainable=True)

    def forward(self, batch):
        return self.a(self.make(batch.dense)).sum() + self.b(batch.by_name["u"]).sum()


class MakeKJT(nn.Module):
    """Builds a KJT from the dense tensor; with or without a trainable parameter."""

    def __init__(self, trainable: bool) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()), requires_grad=trainable)

    def forward(self, dense):
        return KeyedJaggedTensor.from_lengths_sync(
            keys=["x"], values=dense.flatten().long(), lengths=torch.full((2,), dense.shape[1])
        )


class FromAttribute(Model):
    def __init__(self) -> None:
        super().__init__()
        self.fixed = kjt(["x"])

    def forward(self, batch):
        return self.a(self.fixed).sum() + self.b(batch.by_name["u"]).sum()


class TorchFunction(Model):
    def forward(self, batch):
        features = batch.inner.kjt
        rebuilt = KeyedJaggedTensor(
            keys=["x"], values=torch.flip(features.values(), [0]), lengths=features.lengths()
        )
        return self.a(rebuilt).sum() + self.b(batch.by_name["u"]).sum()


@pytest.mark.parametrize(
    ("model_type", "reason"),
    [
        (FromValuesMax, "call_method 'max'"),
        (TrainableInput, "trainable parameters"),
        (FromAttribute, "not derived from the batch"),
        (TorchFunction, "call_function 'flip'"),
    ],
)
def test_rejected_patterns_keep_original_forward(model_type, reason):
    model, batch = model_type(), outer_batch()
    expected = model(batch)
    slot = ContextSlot()
    rw = rewrite_model(model, batch, slot=slot)
    by_fqn = {m.fqn: m for m in rw.report.modules}
    assert not by_fqn["a"].pipelined and reason in by_fqn["a"].reason
    assert by_fqn["b"].pipelined
    assert "forward" not in vars(model.a)  # runs its original forward
    assert torch.equal(run_pipelined(model, rw, slot, batch), expected)
    with pytest.raises(RewriteError, match=r"(?s)1 sharded module.*\ba:"):
        rewrite_model(model_type(), batch, slot=slot, strict=True)


class WithPostproc(Model):
    def __init__(self) -> None:
        super().__init__()
        self.make = MakeKJT(trainable=False)

    def forward(self, batch):
        return self.a(self.make(batch.dense)).sum() + self.b(batch.by_name["u"]).sum()


def test_postproc_needs_opt_in_and_is_pipelined_with_it():
    batch = outer_batch()
    rw = rewrite_model(WithPostproc(), batch, slot=ContextSlot())
    assert "pipeline_postproc=True" in rw.report.not_pipelined[0].reason

    model = WithPostproc()
    expected = model(batch)
    slot = ContextSlot()
    rw = rewrite_model(model, batch, slot=slot, pipeline_postproc=True)
    assert rw.report.pipelined == ["a", "b"]
    assert list(rw.postprocs) == ["make"]
    assert {m.fqn: m.path for m in rw.report.modules}["a"] == "make(batch.dense)"
    assert torch.equal(run_pipelined(model, rw, slot, batch), expected)
    rw.restore()
    assert "forward" not in vars(model.make)


class PostprocTwice(WithPostproc):
    def forward(self, batch):
        other = self.make(batch.dense + 1)  # a second call, on other values
        return self.a(self.make(batch.dense)).sum() + self.b(batch.by_name["u"]).sum() + other.values().sum()


def test_postproc_called_twice_is_not_run_ahead():
    model, batch = PostprocTwice(), outer_batch()
    expected = model(batch)
    slot = ContextSlot()
    rw = rewrite_model(model, batch, slot=slot, pipeline_postproc=True)
    assert "calls 2 times" in rw.report.not_pipelined[0].reason
    assert rw.postprocs == {} and "forward" not in vars(model.make)
    assert torch.equal(run_pipelined(model, rw, slot, batch), expected)


# -- lists, tuples and dicts of batch values ------------------------------------------------------


class Shift(nn.Module):
    """Parameter-free postproc taking collections: the KJT in `parts[0]` with its ids shifted by
    `opts["by"]` plus one where `parts[1]` (a dense tensor) sums above zero."""

    def forward(self, parts, opts):
        features, dense = parts
        features = getattr(features, "kjt", features)  # also accepts an Inner
        values = features.values().clone()
        values += (dense.sum() > 0).long() + opts["by"]  # a data-dependent value: fails on an fx Node
        return KeyedJaggedTensor.from_lengths_sync(
            keys=features.keys(), values=values % 10, lengths=features.lengths()
        )


Pair = namedtuple("Pair", ["kjt", "extra"])


class PackedInput(FakeSharded):
    """A sharded module whose input is a collection: `module([{"kjt": kjt}], Pair(kjt2, n))`."""

    def input_dist(self, ctx, parts, pair):
        assert isinstance(parts, list) and isinstance(parts[0], dict) and isinstance(pair, Pair)
        return _Ready(_Ready(parts[0]["kjt"]))


class WithCollections(Model):
    def __init__(self, how: str = "collections") -> None:
        super().__init__()
        self.how = how
        self.make = MakeKJT(trainable=False)
        self.shift = Shift()
        self.b = PackedInput(["u"])

    def forward(self, batch):
        u = self.b([{"kjt": batch.by_name["u"]}], Pair(batch.by_name["u"], 3))
        if self.how == "collections":  # a postproc output, nested list/tuple/dict, constants
            x = self.shift((self.make(batch.dense), batch.dense), {"by": 1, "more": [batch.inner.kjt]})
        elif self.how == "slice":
            x = self.shift([batch.inner.kjt, batch.dense], {"by": 1, "rows": slice(0, batch.dense.shape[0])})
        else:  # "dataclass"
            x = self.shift([Inner(kjt=batch.inner.kjt), batch.dense], {"by": 1})
        return self.lin(batch.dense).sum() + self.a(x).sum() + u.sum()


def test_collections_of_batch_values_are_rebuilt_for_each_batch():
    model, batches = WithCollections(), [outer_batch(), outer_batch(seed=5)]
    batches[1].dense = -batches[1].dense  # a different shift for the second batch
    expected = [model(b) for b in batches]
    slot = ContextSlot()
    rw = rewrite_model(model, batches[0], slot=slot, pipeline_postproc=True, strict=True)
    paths = {m.fqn: m.path for m in rw.report.modules}
    assert paths == {
        "a": "shift((make(batch.dense), batch.dense), {'by': 1, 'more': [batch.inner.kjt]})",
        "b": "[{'kjt': batch.by_name['u']}], Pair(batch.by_name['u'], 3)",
    }
    assert sorted(rw.postprocs) == ["make", "shift"]
    got = [run_pipelined(model, rw, slot, b) for b in batches]
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    assert not torch.equal(got[0], got[1])


@pytest.mark.parametrize(
    ("how", "reason"),
    [("slice", "input passes a slice built from batch values"), ("dataclass", "Inner dataclass built")],
)
def test_collection_that_cannot_be_rebuilt_leaves_the_module_unpipelined(how, reason):
    model, batch = WithCollections(how), outer_batch()
    expected = model(batch)
    slot = ContextSlot()
    rw = rewrite_model(model, batch, slot=slot, pipeline_postproc=True)
    by_fqn = {m.fqn: m for m in rw.report.modules}
    assert not by_fqn["a"].pipelined and reason in by_fqn["a"].reason
    assert by_fqn["b"].pipelined and rw.postprocs == {}
    assert torch.equal(run_pipelined(model, rw, slot, batch), expected)  # no failure at run time


class WithNestedSharded(Model):
    """`a` holds a sharded module of its own, as a sharded FP-EBC holds its sharded EBC."""

    def __init__(self) -> None:
        super().__init__()
        self.a.inner = FakeSharded(["x"])


def test_sharded_module_inside_another_is_not_a_module_of_its_own():
    model, batch = WithNestedSharded(), outer_batch()
    rw = rewrite_model(model, batch, slot=ContextSlot(), strict=True)  # no "a.inner not called"
    assert [m.fqn for m in rw.report.modules] == ["a", "b"]
    assert rw.report.pipelined == ["a", "b"]
    assert "forward" not in vars(model.a.inner)


# -- misuse and restore -------------------------------------------------------------------------


def test_direct_call_while_attached_says_how_to_detach():
    model, batch = Model(), outer_batch()
    rewrite_model(model, batch, slot=ContextSlot())
    with pytest.raises(NotPreparedError, match=r"pipeline\.detach\(\)"):
        model(batch)


class LookupCtx(Ctx):
    """Runs each module's `compute_and_output_dist` ahead, as the lookup pipelines do."""

    def __init__(self, rewrite, batch) -> None:
        super().__init__(rewrite, batch)
        self.lookups = {
            pm.fqn: pm.module.compute_and_output_dist(*self.prepared.pop(pm.fqn)) for pm in rewrite.modules
        }

    def take_lookup(self, fqn):
        return self.lookups.pop(fqn, None)


def test_lookup_forward_returns_the_lookup_run_ahead():
    model, batch = Model(), outer_batch()
    expected = model(batch)
    slot = ContextSlot()
    rw = rewrite_model(model, batch, slot=slot, lookup=True)
    assert type(model.a.forward).__name__ == "LookupPipelinedForward"
    slot.current = LookupCtx(rw, batch)
    try:
        assert torch.equal(model(batch), expected)
        with pytest.raises(NotPreparedError, match="embedding lookup"):
            model(batch)  # the lookups were taken: a second call has nothing prepared
    finally:
        slot.current = None


def test_restore_is_exact():
    model, batch = Model(), outer_batch()
    custom = lambda features: torch.zeros(1)  # noqa: E731 - a user's own instance forward
    model.b.forward = custom
    before = model(batch)
    keys = list(model.state_dict())
    rw = rewrite_model(model, batch, slot=ContextSlot())
    assert list(model.state_dict()) == keys
    assert model.a.is_pipelined and model.b.is_pipelined
    rw.restore()
    assert "forward" not in vars(model.a) and model.b.forward is custom
    assert not model.a.is_pipelined and not model.b.is_pipelined
    assert list(model.state_dict()) == keys
    assert torch.equal(model(batch), before)
