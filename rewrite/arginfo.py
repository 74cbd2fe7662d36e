"""ArgInfo: how one argument of a sharded module's forward is obtained from the batch.

An ArgInfo is an ordered list of steps (attribute, item, constant) applied to the batch, optionally
starting from something other than the batch itself: the output of a parameter-free "postproc"
module (`PostprocCall`), or a list, tuple or dict built from other ArgInfos (`Pack`). A CallArgs
holds the positional and keyword ArgInfos of one call. Paths are written and parsed in Python syntax
relative to the batch: `sparse_features`, `a.b`, `features["user"]`, `[0]`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ArgInfo",
    "Attr",
    "CallArgs",
    "Const",
    "Item",
    "Pack",
    "PathError",
    "PostprocCall",
    "parse_path",
]


class PathError(ValueError):
    """An explicit path could not be parsed or does not resolve on the batch."""


@dataclass(frozen=True, slots=True)
class Attr:
    """`value.name`"""

    name: str

    def apply(self, value: Any) -> Any:
        return getattr(value, self.name)

    def process(self, value: Any) -> Any:
        """torchrec's name for `apply` (its `ArgInfoStep.process`)."""
        return self.apply(value)

    def __str__(self) -> str:
        return f".{self.name}"


@dataclass(frozen=True, slots=True)
class Item:
    """`value[key]` for a dict key or a sequence index."""

    key: str | int

    def apply(self, value: Any) -> Any:
        return value[self.key]

    def process(self, value: Any) -> Any:
        """torchrec's name for `apply` (its `ArgInfoStep.process`)."""
        return self.apply(value)

    def __str__(self) -> str:
        return f"[{self.key!r}]"


@dataclass(frozen=True, slots=True)
class Const:
    """A constant argument, independent of the batch (e.g. a flag passed to forward)."""

    value: Any

    def apply(self, value: Any) -> Any:
        return self.value

    def process(self, value: Any) -> Any:
        """torchrec's name for `apply` (its `ArgInfoStep.process`)."""
        return self.apply(value)

    def __str__(self) -> str:
        return f"<const {self.value!r}>"


Step = Attr | Item | Const


@dataclass(frozen=True, slots=True)
class PostprocCall:
    """The output of parameter-free module `fqn` called with arguments taken from the batch."""

    fqn: str
    args: CallArgs

    def __str__(self) -> str:
        return f"{self.fqn}({self.args})"


@dataclass(frozen=True, slots=True)
class Pack:
    """A list, tuple (or namedtuple) or dict built anew for each batch from ArgInfos.

    `[batch.a, batch.b]`, `{"x": batch.sparse, "n": 1}`: each item is an ArgInfo, so items may be
    constants, postproc outputs or Packs themselves (nested collections).
    """

    kind: type
    """list, tuple, a namedtuple class, or dict."""
    items: tuple[ArgInfo, ...]
    keys: tuple[Any, ...] = ()
    """For a dict: its keys, in the order of `items`."""

    def build(self, batch: Any, postproc: Any = None) -> Any:
        """A new collection of the items' values for `batch` (see `ArgInfo.resolve`)."""
        values = [item.resolve(batch, postproc) for item in self.items]
        if self.kind is dict:
            return dict(zip(self.keys, values, strict=True))
        if hasattr(self.kind, "_fields"):
            return self.kind(*values)
        return self.kind(values)

    def __str__(self) -> str:
        parts = [str(item) for item in self.items]
        if self.kind is dict:
            return "{" + ", ".join(f"{k!r}: {p}" for k, p in zip(self.keys, parts, strict=True)) + "}"
        if self.kind is list:
            return "[" + ", ".join(parts) + "]"
        if self.kind is tuple:
            return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"
        return f"{self.kind.__name__}(" + ", ".join(parts) + ")"


@dataclass(frozen=True, slots=True)
class ArgInfo:
    """Steps applied, in order, to the batch (or to a postproc module's output, or a Pack)."""

    steps: tuple[Step, ...] = ()
    source: PostprocCall | Pack | None = None
    """When set, the steps start from this postproc module's output, or from this collection,
    instead of the batch."""

    def resolve(self, batch: Any, postproc: Any = None) -> Any:
        """The argument's value for `batch`.

        Args:
            batch: the batch the model's forward receives.
            postproc: callable `(PostprocCall, batch) -> output`, needed when a PostprocCall is
                the source of this ArgInfo or of any ArgInfo inside it.
        """
        if self.source is None:
            value = batch
        elif isinstance(self.source, Pack):
            value = self.source.build(batch, postproc)
        else:
            value = postproc(self.source, batch)
        for step in self.steps:
            value = step.apply(value)
        return value

    def postprocs(self) -> list[PostprocCall]:
        """Every postproc call this argument depends on, innermost first."""
        if isinstance(self.source, PostprocCall):
            return [*self.source.args.postprocs(), self.source]
        if isinstance(self.source, Pack):
            return [call for item in self.source.items for call in item.postprocs()]
        return []

    def __str__(self) -> str:
        steps = self.steps
        if steps and isinstance(steps[0], Const):
            head, steps = repr(steps[0].value), steps[1:]
        else:
            head = "batch" if self.source is None else str(self.source)
        return head + "".join(str(s) for s in steps)


@dataclass(frozen=True, slots=True)
class CallArgs:
    """Positional and keyword ArgInfos of one forward call."""

    args: tuple[ArgInfo, ...] = ()
    kwargs: dict[str, ArgInfo] = field(default_factory=dict)

    def build(self, batch: Any, postproc: Any = None) -> tuple[list[Any], dict[str, Any]]:
        """The call's `(args, kwargs)` for `batch`."""
        args = [a.resolve(batch, postproc) for a in self.args]
        kwargs = {k: a.resolve(batch, postproc) for k, a in self.kwargs.items()}
        return args, kwargs

    def postprocs(self) -> list[PostprocCall]:
        """Every postproc call this call depends on, innermost first."""
        return [call for info in (*self.args, *self.kwargs.values()) for call in info.postprocs()]

    def __str__(self) -> str:
        parts = [str(a) for a in self.args] + [f"{k}={a}" for k, a in self.kwargs.items()]
        return ", ".join(parts)


_TOKEN = re.compile(
    r"""\.?(?P<attr>[A-Za-z_]\w*)            # name or .name
      | \[\s*(?P<int>-?\d+)\s*\]            # [0]
      | \[\s*(?P<q>['"])(?P<str>.*?)(?P=q)\s*\]  # ['key'] or ["key"]
    """,
    re.VERBOSE,
)


def parse_path(text: str) -> ArgInfo:
    """Parse a path relative to the batch, e.g. `item_features['kjt']` or `[0].sparse`.

    A leading `batch` is accepted and ignored (`batch.sparse_features` == `sparse_features`).

    Raises:
        PathError: the text is not a sequence of `.name`, `[int]` and `['key']` steps.
    """
    steps: list[Step] = []
    pos, text = 0, text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None or (m.group("attr") and pos > 0 and text[pos] != "."):
            raise PathError(
                f"cannot parse path {text!r} at character {pos}: write it as Python attribute and "
                "item access relative to the batch, e.g. sparse_features or features['user'] or [0]"
            )
        if m.group("attr") is not None:
            steps.append(Attr(m.group("attr")))
        elif m.group("int") is not None:
            steps.append(Item(int(m.group("int"))))
        else:
            steps.append(Item(m.group("str")))
        pos = m.end()
    if steps and steps[0] == Attr("batch") and text.startswith("batch"):
        steps = steps[1:]
    if not steps:
        raise PathError(f"empty path {text!r}: name the batch attribute or key holding the KJT")
    return ArgInfo(tuple(steps))
