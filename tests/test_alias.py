"""`torchrec_pipeline`, the `pipeline` package under a second name: the same objects and the same
submodules (not copies); usable beside a project's own `pipeline` module inside its package; a
clear error when a top-level `pipeline` module hides the library; and packaged in the wheel."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import pipeline
import torchrec_pipeline

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", pipeline.__all__)
def test_every_export_is_the_same_object(name):
    assert name in torchrec_pipeline.__all__
    assert getattr(torchrec_pipeline, name) is getattr(pipeline, name), name


def test_every_submodule_is_the_same_module_under_both_names():
    names = [info.name for info in pkgutil.walk_packages(pipeline.__path__, prefix="pipeline.")]
    assert "pipeline.options" in names and "pipeline.stages.schedule" in names
    for name in names:
        alias = "torchrec_pipeline" + name[len("pipeline") :]
        assert importlib.import_module(alias) is importlib.import_module(name), alias
    from torchrec_pipeline.options import RankOptions

    assert RankOptions is pipeline.options.RankOptions
    assert (
        torchrec_pipeline.options is pipeline.options
        and torchrec_pipeline.stages.schedule is pipeline.stages.schedule
    )


def _python(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
def test_beside_a_projects_own_pipeline_module(tmp_path):
    project = tmp_path / "proj"
    project.mkdir()
    (project / "__init__.py").write_text("")
    (project / "pipeline.py").write_text("STEPS = 3\n")
    (project / "train.py").write_text(
        "from proj import pipeline\n"
        "from torchrec_pipeline import TrainPipelineSparseDist\n"
        "import torchrec_pipeline.options\n"
        "options = torchrec_pipeline.options.RankOptions\n"
        "print(pipeline.STEPS, TrainPipelineSparseDist.__module__, options.__name__)\n"
    )
    done = _python(tmp_path, "-m", "proj.train")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["3", "pipeline.pipelines.sparse_dist", "RankOptions"]


@pytest.mark.slow
def test_a_top_level_pipeline_module_that_hides_the_library_is_named(tmp_path):
    (tmp_path / "pipeline.py").write_text("STEPS = 3\n")
    (tmp_path / "train.py").write_text("import torchrec_pipeline\n")
    done = _python(tmp_path, "train.py")
    assert done.returncode != 0
    assert "the module named 'pipeline' found first is not this library's" in done.stderr, done.stderr
    assert str(tmp_path / "pipeline.py") in done.stderr


@pytest.mark.slow
def test_the_wheel_ships_the_module():
    # the module beside the packages (setuptools' py-modules); tested by hand: pip wheel, install, import
    assert 'py-modules = ["torchrec_pipeline"]' in (ROOT / "pyproject.toml").read_text()
    assert Path(torchrec_pipeline.__file__).resolve() == ROOT / "torchrec_pipeline.py"
