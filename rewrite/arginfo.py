"""ArgInfo: a small program that computes one argument of a sharded module's forward from the batch.

A program is an ordered tuple of steps applied to a start value: attribute (`Attr`), item (`Item`),
constant (`Const`), or a pure method with constant arguments (`Call`, see `rewrite.ops`). The start
value is the batch, or: the output of a parameter-free "postproc" module (`PostprocCall`), a list,
tuple or dict of programs (`Pack`), a KeyedJaggedTensor or JaggedTensor constructed from programs
(`Build`), or another program (a shared sub-program, computed once per batch). A CallArgs holds the
positional and keyword programs of one call. Each prints as the Python that produced it:
`batch.sparse.split([2, 3])[0]`, `KeyedJaggedTensor(keys=['a'], values=batch.ids, lengths=batch.n)`.

Replay passes a per-batch `cache`: a program that ends in a method call or a construction is then
evaluated once per batch however many call sites read it (keyed by the program object, which the
trace and the recording share between the sites that use the same value).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from operator import attrgetter
from typing import Any, ClassVar

from rewrite.ops import CONSTRUCTORS, METHODS, own_receiver

__all__ = [
    "ArgInfo",
    "Attr",
    "Build",
    "Call",
    "CallArgs",
    "Const",
    "Item",
    "Pack",
    "PathError",
    "PostprocCall",
    "parse_path",
]


class PathError(ValueError):
    """An explicit path or input could not be parsed, or does not resolve on the batch."""


@dataclass(frozen=True, slots=True)
class Attr:
    """`value.name`"""

    name: str
    cached: ClassVar[bool] = False

    def apply(self, value: Any) -> Any:
        return getattr(value, self.name)

    process = apply  # torchrec's name (its `ArgInfoStep.process`)

    def __str__(self) -> str:
        return f".{self.name}"


@dataclass(frozen=True, slots=True)
class Item:
    """`value[key]` for a dict key, a sequence index, or a KeyedJaggedTensor's feature."""

    key: str | int
    cached: ClassVar[bool] = False

    def apply(self, value: Any) -> Any:
        return own_receiver(value)[self.key]

    process = apply  # torchrec's name (its `ArgInfoStep.process`)

    def __str__(self) -> str:
        return f"[{self.key!r}]"


@dataclass(frozen=True, slots=True)
class Const:
    """A constant argument, independent of the batch (e.g. a flag passed to forward)."""

    value: Any
    cached: ClassVar[bool] = False

    def apply(self, value: Any) -> Any:
        return self.value

    process = apply  # torchrec's name (its `ArgInfoStep.process`)

    def __str__(self) -> str:
        return f"<const {self.value!r}>"


@dataclass(frozen=True, slots=True)
class Call:
    """`value.name(*args, **kwargs)`: a pure method of `rewrite.ops.METHODS`, constant arguments."""

    name: str
    args: tuple[Any, ...] = ()
    kwargs: tuple[tuple[str, Any], ...] = ()
    cached: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.name not in METHODS:
            raise ValueError(f"{self.name!r} is not a pure method a program may replay: {sorted(METHODS)}")

    def apply(self, value: Any) -> Any:
        if not isinstance(value, METHODS[self.name]):
            kinds = " or ".join(t.__name__ for t in METHODS[self.name])
            raise TypeError(f".{self.name}() is replayed only on a {kinds}, not a {type(value).__name__}")
        return getattr(own_receiver(value), self.name)(*self.args, **dict(self.kwargs))

    def __str__(self) -> str:
        parts = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs]
        return f".{self.name}({', '.join(parts)})"


Step = Attr | Item | Const | Call


@dataclass(frozen=True, slots=True)
class PostprocCall:
    """The output of parameter-free module `fqn` called with arguments taken from the batch."""

    fqn: str
    args: CallArgs
    cached: ClassVar[bool] = False  # the postproc runner caches by module

    def build(self, batch: Any, postproc: Any = None, cache: dict | None = None) -> Any:
        if postproc is None:
            raise ValueError(f"{self} needs a postproc runner (see ArgInfo.resolve)")
        return postproc(self, batch)

    def postprocs(self) -> list[PostprocCall]:
        return [*self.args.postprocs(), self]

    def __str__(self) -> str:
        return f"{self.fqn}({self.args})"


@dataclass(frozen=True, slots=True)
class Build:
    """A KeyedJaggedTensor or JaggedTensor constructed for each batch by `rewrite.ops.CONSTRUCTORS`
    `[name]` from programs (keys and other constants are `Const` programs)."""

    name: str
    args: CallArgs
    cached: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.name not in CONSTRUCTORS:
            raise ValueError(
                f"{self.name!r} is not a constructor a program may replay: {sorted(CONSTRUCTORS)}"
            )

    def build(self, batch: Any, postproc: Any = None, cache: dict | None = None) -> Any:
        args, kwargs = self.args.build(batch, postproc, cache)
        return CONSTRUCTORS[self.name](*args, **kwargs)

    def postprocs(self) -> list[PostprocCall]:
        return self.args.postprocs()

    def __str__(self) -> str:
        return f"{self.name}({self.args})"


@dataclass(frozen=True, slots=True)
class Pack:
    """A list, tuple (or namedtuple) or dict of ArgInfos built anew for each batch: `[batch.a,
    batch.b]`, `{"x": batch.sparse, "n": 1}`; items may be constants, postproc outputs or Packs."""

    kind: type
    """list, tuple, a namedtuple class, or dict."""
    items: tuple[ArgInfo, ...]
    keys: tuple[Any, ...] = ()
    """For a dict: its keys, in the order of `items`."""
    cached: ClassVar[bool] = False

    def build(self, batch: Any, postproc: Any = None, cache: dict | None = None) -> Any:
        """A new collection of the items' values for `batch` (see `ArgInfo.resolve`)."""
        values = [item.resolve(batch, postproc, cache) for item in self.items]
        if self.kind is dict:
            return dict(zip(self.keys, values, strict=True))
        if hasattr(self.kind, "_fields"):
            return self.kind(*values)
        return self.kind(values)

    def postprocs(self) -> list[PostprocCall]:
        return [call for item in self.items for call in item.postprocs()]

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
    """Steps applied, in order, to the batch (or to the value of `source`)."""

    steps: tuple[Step, ...] = ()
    source: PostprocCall | Pack | Build | ArgInfo | None = None
    """When set, the steps start from this value instead of the batch: a postproc module's
    output, a collection, a construction, or a shared sub-program."""
    read: Callable[[Any], Any] = field(init=False, repr=False, compare=False)
    """`resolve(batch)`, made once: attribute reads from the batch are one `operator.attrgetter`."""

    def __post_init__(self) -> None:
        names = [s.name for s in self.steps if isinstance(s, Attr) and "." not in s.name]
        chain = self.source is None and len(names) == len(self.steps) > 0
        read = attrgetter(".".join(names)) if chain else partial(_run, self.steps, self.source)
        object.__setattr__(self, "read", read)  # a function of the steps, not of self: no cycle

    @property
    def cached(self) -> bool:
        """Replay with a cache computes it once per batch: it ends in a method call or a construction."""
        last = self.steps[-1] if self.steps else self.source
        return last is not None and last.cached

    @property
    def is_path(self) -> bool:
        """Only attribute and item steps from the batch (or a constant)."""
        if self.steps and isinstance(self.steps[0], Const):
            return True
        return self.source is None and all(isinstance(s, (Attr, Item)) for s in self.steps)

    def then(self, step: Step) -> ArgInfo:
        """This program followed by `step`. A program computed once per batch becomes the source of
        the new one, so that every program continuing from it shares its value."""
        return ArgInfo((step,), source=self) if self.cached else ArgInfo((*self.steps, step), self.source)

    def resolve(self, batch: Any, postproc: Any = None, cache: dict | None = None) -> Any:
        """The argument's value for `batch`.

        Args:
            batch: the batch the model's forward receives.
            postproc: callable `(PostprocCall, batch) -> output`, needed when a PostprocCall is
                the source of this ArgInfo or of any ArgInfo inside it.
            cache: a dict kept for one batch: programs ending in a method call or a construction
                are computed once per batch and shared (None: computed at every use).
        """
        if cache is None or not self.cached:
            return _run(self.steps, self.source, batch, postproc, cache)
        hit = cache.get(id(self))
        if hit is None:  # keeping the program in the entry keeps its id from being reused
            hit = cache[id(self)] = (self, _run(self.steps, self.source, batch, postproc, cache))
        return hit[1]

    build = resolve  # as the source of another program

    def postprocs(self) -> list[PostprocCall]:
        """Every postproc call this argument depends on, innermost first."""
        return [] if self.source is None else self.source.postprocs()

    def __str__(self) -> str:
        steps = self.steps
        if steps and isinstance(steps[0], Const):
            head, steps = repr(steps[0].value), steps[1:]
        else:
            head = "batch" if self.source is None else str(self.source)
        return head + "".join(str(s) for s in steps)


def _run(steps: tuple[Step, ...], source: Any, batch: Any, postproc: Any = None, cache: Any = None) -> Any:
    value = batch if source is None else source.build(batch, postproc, cache)
    for step in steps:
        value = step.apply(value)
    return value


@dataclass(frozen=True, slots=True)
class CallArgs:
    """Positional and keyword ArgInfos of one forward call."""

    args: tuple[ArgInfo, ...] = ()
    kwargs: dict[str, ArgInfo] = field(default_factory=dict)

    @property
    def is_path(self) -> bool:
        """Every argument is an attribute/item path from the batch, or a constant."""
        return all(a.is_path for a in (*self.args, *self.kwargs.values()))

    def build(self, batch: Any, postproc: Any = None, cache: dict | None = None) -> tuple[list, dict]:
        """The call's `(args, kwargs)` for `batch` (see `ArgInfo.resolve`)."""
        args = [a.resolve(batch, postproc, cache) for a in self.args]
        kwargs = {k: a.resolve(batch, postproc, cache) for k, a in self.kwargs.items()}
        return args, kwargs

    def postprocs(self) -> list[PostprocCall]:
        """Every postproc call this call depends on, innermost first."""
        return [call for info in (*self.args, *self.kwargs.values()) for call in info.postprocs()]

    def __str__(self) -> str:
        return ", ".join([str(a) for a in self.args] + [f"{k}={a}" for k, a in self.kwargs.items()])


# -- explicit paths: `sparse_features`, `a.b`, `features["user"]`, `[0]`, in Python syntax relative to
# the batch (a leading `batch` is accepted) ---------------------------------------------------------

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
    steps: list[Attr | Item] = []
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
