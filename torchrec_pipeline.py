"""`torchrec_pipeline`: the `pipeline` package under a second name, for code that has a `pipeline`
of its own (a module in its package, a variable, an argument) or that wants the import to say
what it is:

    from torchrec_pipeline import TrainPipelineSparseDist
    from torchrec_pipeline.options import RankOptions

Every name is the same object as in `pipeline` (`torchrec_pipeline.TrainPipelineSparseDist is
pipeline.TrainPipelineSparseDist`), and every submodule of `pipeline` is importable under this
name too, as the same module (`torchrec_pipeline.options is pipeline.options`). The library itself is
still the top-level package `pipeline`: a top-level module of that name earlier on `sys.path` (a
`pipeline.py` beside your script) hides it, and importing `torchrec_pipeline` then fails, saying so.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import pipeline
from pipeline import *  # noqa: F403  (the exports, for editors and type checkers)

if "TrainPipelineSparseDist" not in getattr(pipeline, "__all__", ()):
    raise ImportError(
        f"torchrec_pipeline: the module named 'pipeline' found first is not this library's "
        f"({getattr(pipeline, '__file__', None) or pipeline!r}); rename your own top-level "
        "'pipeline' module or move it into a package, so that this library's package is found"
    )

__all__ = list(pipeline.__all__)


def _register_submodules() -> None:
    """Make every submodule of `pipeline` importable as the same module under this name."""
    this = sys.modules[__name__]
    for info in pkgutil.walk_packages(pipeline.__path__, prefix="pipeline."):
        module = importlib.import_module(info.name)
        alias = __name__ + info.name[len("pipeline") :]
        sys.modules.setdefault(alias, module)
        parent, _, child = alias.rpartition(".")
        if parent == __name__:
            setattr(this, child, module)


_register_submodules()
