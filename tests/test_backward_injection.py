"""Our backward-injection API (`pipeline.InjectionSite`, the finders, `register_backward_hook`)
against torchrec's own, on small dense models in one process: the same parameter is hooked for
every position, the same tensor is found, the same errors are raised (a clearer ValueError where
torchrec asserts). The output all-to-all site on sharded models is tests/test_backward_opt.py's."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torchrec.distributed.train_pipeline import backward_injection as theirs
from torchrec.distributed.types import NoWait, ShardingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import pipeline


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(3, 3)
        self.frozen.requires_grad_(False)
        self.body = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
        self.head = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.frozen(x))).sum()


def _which_parameter(register, site, model: nn.Module) -> list[int]:
    """Ids of the parameters whose gradient the hook received in one backward."""
    seen: list[int] = []
    by_grad = {}
    handle = register(site, model, lambda grad: seen.append(id(grad)))
    model.zero_grad()
    model(torch.ones(2, 3)).backward()
    for p in model.parameters():
        if p.grad is not None:
            by_grad[id(p.grad)] = id(p)
    handle.remove()
    return [by_grad[g] for g in seen]


@pytest.mark.parametrize("position", [0.0, 0.2, 0.5, 0.99, 1.0, -3.0, 7.0])
@pytest.mark.parametrize("fqn", ["", "body", "head"])
def test_param_grad_site_hooks_the_parameter_torchrec_hooks(position, fqn):
    model = _Net()
    ours = pipeline.InjectionSite(
        fqn, pipeline.FirstGradTensorFinder(), pipeline.InjectionTargetType.PARAM_GRAD, position
    )
    reference = theirs.InjectionSite(
        fqn, theirs.FirstGradTensorFinder(), theirs.InjectionTargetType.PARAM_GRAD, position
    )
    hooked = _which_parameter(pipeline.register_backward_hook, ours, model)
    assert len(hooked) == 1, f"site {fqn!r} at {position}: the hook fired {len(hooked)} times"
    assert hooked == _which_parameter(theirs.register_backward_hook, reference, model), (
        f"site {fqn!r} at {position}: another parameter than torchrec's"
    )


def test_activation_site_fires_with_the_found_tensors_gradient():
    model = _Net()
    grads: list[torch.Tensor] = []
    site = pipeline.InjectionSite("body", pipeline.FirstGradTensorFinder())
    handle = pipeline.register_backward_hook(site, model, grads.append)
    model(torch.ones(2, 3)).backward()
    model(torch.ones(2, 3)).backward()
    handle.remove()
    model(torch.ones(2, 3)).backward()
    assert [g.shape for g in grads] == [torch.Size([2, 2])] * 2, "one gradient of body's output per backward"


def test_torchrecs_site_objects_are_accepted():
    model = _Net()
    fired: list[bool] = []
    site = theirs.InjectionSite("head", theirs.FirstGradTensorFinder(), theirs.InjectionTargetType.PARAM_GRAD)
    pipeline.register_backward_hook(site, model, lambda grad: fired.append(True))
    model(torch.ones(2, 3)).backward()
    assert fired == [True], "torchrec's InjectionSite (PARAM_GRAD) did not fire through ours"


def test_errors_say_what_is_wrong():
    model = _Net()
    finder = pipeline.FirstGradTensorFinder()
    with pytest.raises(ValueError, match="module 'nope' not found"):
        pipeline.register_backward_hook(pipeline.InjectionSite("nope", finder), model, print)
    frozen = pipeline.InjectionSite("frozen", finder, pipeline.InjectionTargetType.PARAM_GRAD)
    with pytest.raises(ValueError, match=r"no hookable parameter.*2 without grad"):
        pipeline.register_backward_hook(frozen, model, print)
    with pytest.raises(AssertionError):  # torchrec asserts where ours raises a ValueError
        theirs.register_backward_hook(
            theirs.InjectionSite(
                "frozen", theirs.FirstGradTensorFinder(), theirs.InjectionTargetType.PARAM_GRAD
            ),
            model,
            print,
        )
    pipeline.register_backward_hook(pipeline.InjectionSite("frozen", finder), model, print)
    with pytest.raises(RuntimeError, match="no grad-requiring tensor in output of 'frozen'"):
        model(torch.ones(2, 3))


def _kjt(weights: torch.Tensor | None) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(
        keys=["f"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1]), weights=weights
    )


def test_first_grad_tensor_finder_searches_as_torchrecs():
    w = torch.ones(2, requires_grad=True)
    t = torch.ones(1, requires_grad=True)
    plain = torch.ones(1)
    cases = [
        ((), {}, (plain, [{"a": plain, "b": t}])),
        ((), {}, _kjt(w)),
        ((), {}, [_kjt(None), plain]),
        ((plain,), {"x": t}, plain),
        ((_kjt(w),), {}, None),
    ]
    for use_input in (False, True):
        ours, reference = pipeline.FirstGradTensorFinder(use_input), theirs.FirstGradTensorFinder(use_input)
        for args, kwargs, output in cases:
            assert ours(args, kwargs, output) is reference(args, kwargs, output), (use_input, args, kwargs)


class _Sharded:
    """What the finder reads of an output awaitable: per sharding type, an awaitable."""

    def __init__(self, awaitables: list, sharding_types: list[str]) -> None:
        self._awaitables, self._sharding_types = awaitables, sharding_types


def test_output_dist_finder_picks_the_sharding_types_all_to_all():
    class _Request:
        pass

    from torchrec.distributed.comm_ops import Request

    request = Request.__new__(Request)
    request.dummy_tensor = torch.ones(1)
    pooled = type("Pooled", (), {"_tensor_awaitable": request})()
    output = _Sharded([NoWait(torch.ones(1)), pooled], ["table_wise", "table_wise"])
    for finder in (pipeline.OutputDistTensorFinder(), theirs.OutputDistTensorFinder()):
        assert finder((), {}, output) is request.dummy_tensor, type(finder).__module__
        assert finder((), {}, (output, None)) is request.dummy_tensor, "managed collision: first of a tuple"
        with pytest.raises(RuntimeError, match="Could not find awaitable for sharding type"):
            type(finder)(ShardingType.ROW_WISE)((), {}, output)
        with pytest.raises(RuntimeError, match="Unsupported awaitable type: Tensor"):
            finder((), {}, torch.ones(1))


@pytest.mark.parametrize(
    "name", ["InjectionSite", "FirstGradTensorFinder", "OutputDistTensorFinder", "InjectionTargetType"]
)
def test_fields_defaults_and_members_are_torchrecs(name):
    ours, reference = getattr(pipeline, name), getattr(theirs, name)
    if name == "InjectionTargetType":
        assert [(m.name, m.value) for m in ours] == [(m.name, m.value) for m in reference]
        return

    def fields(cls) -> list:  # our enum's members stand for torchrec's of the same value
        return [(f.name, getattr(f.default, "value", f.default)) for f in dataclasses.fields(cls)]

    assert fields(ours) == fields(reference)
    assert ours.__dataclass_params__.frozen


def test_will_hook_fire_and_the_finder_protocol():
    assert pipeline.will_hook_fire(nn.Parameter(torch.ones(1)))
    assert not pipeline.will_hook_fire(nn.Parameter(torch.ones(1), requires_grad=False))
    assert not pipeline.will_hook_fire(torch.ones(1, requires_grad=True) * 2)  # not a leaf
    assert isinstance(pipeline.FirstGradTensorFinder(), pipeline.GradTensorFinder)
    assert isinstance(theirs.OutputDistTensorFinder(), pipeline.GradTensorFinder)


class _OneRank(nn.Module):
    """A sharded collection's output as on one rank: its table-wise output "all-to-all" is no
    collective, torchrec hands the embeddings over in a NoWait instead of a Request."""

    def __init__(self) -> None:
        super().__init__()
        self.ebc = _OneRankCollection()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ebc(x)._awaitables[0]._tensor_awaitable._obj.sum()


class _OneRankCollection(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2, 3))

    def forward(self, x: torch.Tensor) -> _Sharded:
        pooled = type("Pooled", (), {"_tensor_awaitable": NoWait(x @ self.weight)})()
        return _Sharded([pooled], ["table_wise"])


def test_a_pipelines_output_dist_site_on_one_rank_is_not_reached():
    """The finder finds nothing on one rank. The public API raises there, as torchrec's does; a
    pipeline's own site (BwdOpt's step, OptStash's restore) hooks nothing, so that forward and
    backward run and the pipeline does its work after backward."""
    from pipeline.compat.backward_injection import hook_backward

    model, fired = _OneRank(), []
    site = pipeline.InjectionSite("ebc", pipeline.OutputDistTensorFinder())
    assert site.tensor_finder((), {}, model.ebc(torch.ones(1, 2))) is None, "one rank's all-to-all found"
    handle = hook_backward(site, model, fired.append, active=lambda: True)
    model(torch.ones(1, 2)).backward()
    handle.remove()
    assert fired == [] and model.ebc.weight.grad is not None, "backward did not run past the site"
    torchrecs = theirs.InjectionSite("ebc", theirs.OutputDistTensorFinder())
    for register, each in (
        (pipeline.register_backward_hook, site),
        (theirs.register_backward_hook, torchrecs),
    ):
        handle = register(each, model, fired.append)
        with pytest.raises(RuntimeError, match="no grad-requiring tensor in output of 'ebc'"):
            model(torch.ones(1, 2))
        handle.remove()
