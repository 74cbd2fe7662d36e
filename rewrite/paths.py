"""Explicit paths: `sparse_features`, `a.b`, `features["user"]`, `[0]`, parsed into an ArgInfo.

Paths are written in Python syntax relative to the batch; a leading `batch` is accepted.
"""

from __future__ import annotations

import re

from rewrite.arginfo import ArgInfo, Attr, Item, PathError

__all__ = ["parse_path"]

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
