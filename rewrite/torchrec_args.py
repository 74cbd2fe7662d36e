"""torchrec 1.8's ArgInfo API, for code written against `torchrec.distributed.train_pipeline`.

`ArgInfo` (a mutable list of steps; `process_steps`, `add_step`, `append_step`), `CallArgs`
(`build_args_kwargs`) and `ArgInfoStepFactory` have torchrec's constructors, methods and results.
The attribute, item and constant steps are rewrite's own (`Attr`, `Item`, `Const` of
`rewrite.arginfo`); the four kinds only this API builds (no-op, postproc module call, list, dict)
are here. `ArgInfo.to_path()` turns one made of attribute and item steps into rewrite's frozen
`rewrite.arginfo.ArgInfo`, so an explicit `arg_paths` entry may be a torchrec ArgInfo.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rewrite import arginfo
from rewrite.arginfo import Attr, Const, Item, PathError

__all__ = ["ArgInfo", "ArgInfoStepFactory", "CallArgs", "CallModule", "DictOf", "ListOf", "Noop"]


@dataclass(frozen=True, slots=True)
class Noop:
    """The value itself (torchrec's `NoopArgInfoStep`: the whole batch as an argument)."""

    def process(self, value: Any) -> Any:
        return value


@dataclass(frozen=True, slots=True, eq=False)
class CallModule:
    """`module(value)`: a postproc module applied to the value (torchrec's `PostprocArgInfoStep`)."""

    module: Any

    def process(self, value: Any) -> Any:
        return self.module(value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CallModule) and other.module is self.module

    def __hash__(self) -> int:
        return id(self.module)


@dataclass(frozen=True, slots=True)
class ListOf:
    """A new list: each item that is an `ArgInfo` resolved on the value, the rest as they are."""

    value: list[Any]

    def process(self, value: Any) -> Any:
        return [v.process_steps(value) if isinstance(v, ArgInfo) else v for v in self.value]


@dataclass(frozen=True, slots=True)
class DictOf:
    """A new dict: each item that is an `ArgInfo` resolved on the value, the rest as they are."""

    value: dict[str, Any]

    def process(self, value: Any) -> Any:
        return {k: v.process_steps(value) if isinstance(v, ArgInfo) else v for k, v in self.value.items()}


@dataclass
class ArgInfo:
    """How one argument is obtained from the batch: `steps` applied in order (torchrec's ArgInfo)."""

    steps: list[Any]
    """Objects with `process(value) -> value`, e.g. from `ArgInfoStepFactory`."""

    def add_step(self, step: Any) -> ArgInfo:
        """Put `step` first (in place); returns self."""
        self.steps.insert(0, step)
        return self

    def append_step(self, step: Any) -> ArgInfo:
        """Put `step` last (in place); returns self."""
        self.steps.append(step)
        return self

    def process_steps(self, arg: Any) -> Any:
        """The argument's value for `arg` (the batch); None when there are no steps, as torchrec's."""
        if not self.steps:
            return None
        for step in self.steps:
            arg = step.process(arg)
        return arg

    def to_path(self) -> arginfo.ArgInfo:
        """rewrite's ArgInfo for the same path.

        Raises:
            PathError: no steps, or a step other than no-op, attribute and item.
        """
        steps = [s for s in self.steps if not isinstance(s, Noop)]
        if not self.steps or not all(isinstance(s, (Attr, Item)) for s in steps):
            raise PathError(f"{self} is not a path of attribute and item steps from the batch")
        return arginfo.ArgInfo(tuple(steps))


@dataclass
class CallArgs:
    """The positional and keyword ArgInfos of one call (torchrec's CallArgs)."""

    args: list[ArgInfo]
    kwargs: dict[str, ArgInfo]

    def build_args_kwargs(self, initial_input: Any) -> tuple[list[Any], dict[str, Any]]:
        """The call's `(args, kwargs)` for the batch `initial_input`."""
        args = [a.process_steps(initial_input) for a in self.args]
        return args, {k: a.process_steps(initial_input) for k, a in self.kwargs.items()}


class ArgInfoStepFactory:
    """torchrec's constructors of ArgInfo steps, by the same names."""

    @classmethod
    def noop(cls) -> Noop:
        return Noop()

    @classmethod
    def get_attr(cls, name: str) -> Attr:
        return Attr(name)

    @classmethod
    def get_item(cls, index: str | int) -> Item:
        return Item(index)

    @classmethod
    def postproc(cls, pipelined_postproc_module: Any) -> CallModule:
        return CallModule(pipelined_postproc_module)

    @classmethod
    def from_scalar(cls, value: object) -> Const:
        return Const(value)

    @classmethod
    def from_list(cls, value: list[object]) -> ListOf:
        return ListOf(value)

    @classmethod
    def from_dict(cls, value: dict[str, object]) -> DictOf:
        return DictOf(value)
