"""Every public class of torchrec's five pipeline modules is in `pipeline`, a drop-in by its import.

The modules: `train_pipelines`, `experimental_pipelines`, `pec_train_pipeline` (torchrec 1.9 on),
`backward_injection` and `pipeline_stage` of `torchrec.distributed.train_pipeline`. The classes are
enumerated from the installed torchrec (defined in the module, not imported into it, no underscore),
so a class a later torchrec adds fails here until it is ours too. For each: the same name in
`pipeline`; a torchrec `TrainPipeline` where torchrec's is; every parameter of torchrec's
constructor by name, in torchrec's order, with torchrec's default; any parameter of ours after them
keyword-only. Where torchrec's takes `*args, **kwargs` and passes them to its base class, its
parameters are the base class's, then its own keyword-only ones. Where torchrec's parameter has no
default, ours may have one (every call of torchrec's is still a call of ours). One process, no
ranks: what each class computes is tested in its own test file.
"""

from __future__ import annotations

import enum
import importlib
import inspect

import pytest
from torchrec.distributed.train_pipeline import TrainPipeline

import pipeline

MODULES = (
    "train_pipelines",
    "experimental_pipelines",
    "pec_train_pipeline",
    "backward_injection",
    "pipeline_stage",
)

# Defaults that differ on purpose, by (class, parameter): our context class, which takes torchrec's
# context classes too (tests/test_compat_names.py checks that).
OWN_DEFAULTS = {"context_type"}
# Parameters torchrec 1.9 added, which ours takes in 1.9's place also when torchrec 1.8 is installed.
NEWER_TORCHREC = {"async_inplace_copy"}


def _module(name: str):
    try:
        return importlib.import_module(f"torchrec.distributed.train_pipeline.{name}")
    except ImportError as e:
        pytest.skip(f"the installed torchrec has no {name} module ({e}): it came with torchrec 1.9")


def _public_classes(module) -> list[str]:
    return sorted(
        n
        for n, o in vars(module).items()
        if inspect.isclass(o) and o.__module__ == module.__name__ and not n.startswith("_")
    )


def _cases() -> list[tuple[str, str]]:
    cases = []
    for name in MODULES:
        try:
            module = importlib.import_module(f"torchrec.distributed.train_pipeline.{name}")
        except ImportError:
            cases.append((name, "*"))  # the module's own case skips, naming why
            continue
        cases += [(name, cls) for cls in _public_classes(module)]
    return cases


def test_the_enumeration_finds_torchrecs_pipelines():
    found = {cls for _, cls in _cases()}
    expected = {
        "TrainPipelineSparseDist",
        "TrainPipelineSparseDistLite",
        "TrainPipelineSparseDistT",
        "TrainPipelineSparseDistBwdOpt",
        "InjectionSite",
        "PipelineStage",
        "SparseDataDistUtil",
    }
    assert expected <= found, f"the enumeration misses {sorted(expected - found)}"


@pytest.mark.parametrize(("module_name", "name"), _cases())
def test_ours_is_torchrecs_drop_in(module_name, name):
    module = _module(module_name)
    theirs = getattr(module, name)
    assert name in pipeline.__all__, f"pipeline does not export torchrec's {module_name}.{name}"
    ours = getattr(pipeline, name)
    if issubclass(theirs, TrainPipeline):
        assert issubclass(ours, TrainPipeline), f"{name}: not a torchrec TrainPipeline as torchrec's is"
    if ours is theirs or not inspect.isclass(ours) or issubclass(theirs, BaseException):
        return  # torchrec's own class re-exported, or an exception: nothing to construct
    _takes_torchrecs_parameters(name, ours, theirs)


def _init_parameters(cls) -> list[inspect.Parameter]:
    try:
        params = list(inspect.signature(cls).parameters.values())
    except (TypeError, ValueError):
        return []
    kinds = {p.kind for p in params}
    if inspect.Parameter.VAR_POSITIONAL in kinds and inspect.Parameter.VAR_KEYWORD in kinds:
        base = next(c for c in cls.__mro__[1:] if "__init__" in vars(c))  # what the *args reach
        own = [p for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
        return [*_init_parameters(base), *own]
    return params


def _takes_torchrecs_parameters(name: str, ours, theirs) -> None:
    mine, torchrecs = _init_parameters(ours), _init_parameters(theirs)
    by_name = {p.name: p for p in mine}
    variadic = {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}
    wanted = [p for p in torchrecs if p.kind not in variadic]
    names = [p.name for p in mine if p.kind not in variadic]
    assert names[: len(wanted)] == [p.name for p in wanted], (
        f"{name}: torchrec's parameters {[p.name for p in wanted]}, ours begin {names[: len(wanted)]}"
    )
    for p in wanted:
        if p.name in OWN_DEFAULTS or p.default is inspect.Parameter.empty:
            continue
        assert _same_default(by_name[p.name].default, p.default), (
            f"{name}({p.name}=...): torchrec's default {p.default!r}, ours {by_name[p.name].default!r}"
        )
    extra = [p for p in mine[len(wanted) :] if p.kind not in variadic]
    positional = [
        p.name for p in extra if p.kind is not inspect.Parameter.KEYWORD_ONLY and p.name not in NEWER_TORCHREC
    ]
    assert not positional, f"{name}: our parameters {positional} after torchrec's must be keyword-only"


def _same_default(a, b) -> bool:
    if a is b:
        return True
    if isinstance(a, enum.Enum) and isinstance(b, enum.Enum):  # an enum of ours mirroring torchrec's
        return type(a).__name__ == type(b).__name__ and a.name == b.name and a.value == b.value
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # tensors and the like: compare by identity only
        return False


# The keywords torchrec 1.9 added to classes of 1.8: (class, keyword, the parameter before it, default).
ADDED_IN_1_9 = [
    ("TrainPipelineSparseDist", "async_inplace_copy", "clear_data_dist_inputs", False),
    ("PrefetchTrainPipelineSparseDist", "async_inplace_copy", "clear_data_dist_inputs", False),
    ("TrainPipelineSparseDistLite", "async_inplace_copy", "clear_data_dist_inputs", False),
    ("TrainEvalHybridPipelineBase", "async_inplace_copy", "clear_data_dist_inputs", False),
]


@pytest.mark.parametrize(("name", "keyword", "after", "default"), ADDED_IN_1_9)
def test_ours_takes_the_keywords_torchrec_1_9_added(name, keyword, after, default):
    """On either stack, in 1.9's place (positional, right after `after`) with 1.9's default; where the
    installed torchrec has the keyword, torchrec's is in that place too (the table is torchrec's).
    What the keyword does: tests/test_async_inplace_copy.py."""
    params = _init_parameters(getattr(pipeline, name))
    names = [p.name for p in params]
    assert keyword in names, f"{name} does not take torchrec 1.9's {keyword}"
    mine = params[names.index(keyword)]
    assert names[names.index(keyword) - 1] == after, f"{name}: {keyword} does not follow {after}: {names}"
    assert mine.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, f"{name}: {keyword} is {mine.kind}"
    assert _same_default(mine.default, default), f"{name}({keyword}=...): default {mine.default!r}"
    theirs = _torchrec_class(name)
    torchrecs = [p.name for p in _init_parameters(theirs)]
    if keyword in torchrecs:
        assert torchrecs.index(keyword) == names.index(keyword), f"torchrec's {name}: {torchrecs}"


def _torchrec_class(name: str):
    for module_name in ("train_pipelines", "experimental_pipelines"):
        module = importlib.import_module(f"torchrec.distributed.train_pipeline.{module_name}")
        if name in vars(module):
            return vars(module)[name]
    raise AssertionError(f"torchrec has no {name}")
