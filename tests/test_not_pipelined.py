"""The warning when a sharded module is not pipelined: on the first batch, once per module and
pipeline, through the "pipeline" logger and `warnings.warn` (`NotPipelinedWarning`), with the reason
and what to do; nothing for a fully pipelined model (the negative twin). One process for the
message, 2 gloo ranks for a real pipeline.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

import pipeline
from pipeline.stages.input_dist import warn_not_pipelined
from rewrite.report import ModuleReport, RewriteReport
from tests import models
from tests.harness import pytest_timeout

TIMEOUT = 120
pytestmark = [pytest.mark.timeout(pytest_timeout(TIMEOUT)), pytest.mark.slow]


def _report() -> RewriteReport:
    return RewriteReport(
        modules=[
            ModuleReport(fqn="user_ebc", pipelined=False, reason="its input comes out of module 'shift'"),
            ModuleReport(fqn="item_ebc", pipelined=True, method="traced", path="batch.item"),
            ModuleReport(fqn="ad_ebc", pipelined=False, reason="called 2 times in one forward"),
        ]
    )


def test_one_warning_and_one_log_record_per_module_not_pipelined(caplog):
    warned: set[str] = set()
    with (
        caplog.at_level(logging.WARNING, logger="pipeline"),
        pytest.warns(pipeline.NotPipelinedWarning) as got,
    ):
        warn_not_pipelined(_report(), warned, pipeline_postproc=False)
        warn_not_pipelined(_report(), warned, pipeline_postproc=False)  # the same pipeline: nothing new
    messages = [str(w.message) for w in got]
    assert len(messages) == 2, messages
    assert [r.getMessage() for r in caplog.records if r.name == "pipeline"] == messages
    assert all(r.levelno == logging.WARNING for r in caplog.records)
    user, ad = messages
    assert user.startswith(
        "sharded module 'user_ebc' is not pipelined: its input comes out of module 'shift'."
    )
    assert "arg_paths={'user_ebc': <path of its input in the batch>}" in user
    assert "pipeline_postproc=True" in user and "strict=True to make this an error" in user
    assert ad.startswith("sharded module 'ad_ebc' is not pipelined: called 2 times in one forward.")
    assert issubclass(pipeline.NotPipelinedWarning, UserWarning)


def test_no_postproc_advice_when_postprocs_run_ahead_already():
    with pytest.warns(pipeline.NotPipelinedWarning) as got:
        warn_not_pipelined(_report(), set(), pipeline_postproc=True)
    assert all("pipeline_postproc" not in str(w.message) for w in got)


def test_a_fully_pipelined_report_warns_nothing(caplog):
    report = RewriteReport(modules=[m for m in _report().modules if m.pipelined])
    with caplog.at_level(logging.WARNING, logger="pipeline"), warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        warn_not_pipelined(report, set(), pipeline_postproc=False)
    assert caplog.records == []


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _pipelines_warn(rank: int, world_size: int, pipeline_postproc: bool) -> dict:
    """Two pipelines on one model, 4 steps each: the warnings and log records of each."""
    handler = _Records()
    logging.getLogger("pipeline").addHandler(handler)
    runs = []
    try:
        model, opt = models.build("postproc", "table_wise")
        for _ in range(2):
            pipe = pipeline.TrainPipelineSparseDist(
                model, opt, torch.device("cpu"), pipeline_postproc=pipeline_postproc
            )
            handler.messages = []
            with warnings.catch_warnings(record=True) as got:
                warnings.simplefilter("always")
                models.run_to_end(pipe, iter(models.batches("postproc", 4, rank)))
            not_pipelined = [m.fqn for m in pipe.rewrite_report.not_pipelined]
            pipe.detach()  # the next pipeline rewrites the model's own forwards
            ours = [str(w.message) for w in got if issubclass(w.category, pipeline.NotPipelinedWarning)]
            runs.append({"warnings": ours, "logged": list(handler.messages), "not_pipelined": not_pipelined})
    finally:
        logging.getLogger("pipeline").removeHandler(handler)
    return {"runs": runs}


def test_a_pipeline_warns_once_per_module_not_pipelined(pool):
    for rank, r in enumerate(pool.run(_pipelines_warn, False, timeout=TIMEOUT)):
        for k, run in enumerate(r["runs"]):
            fqns = [w.split("'")[1] for w in run["warnings"]]
            assert run["not_pipelined"], f"rank {rank}: every module was pipelined, the test proves nothing"
            assert fqns == run["not_pipelined"], f"rank {rank}, pipeline {k}: warned {fqns} over 4 steps"
            assert run["logged"] == run["warnings"], f"rank {rank}, pipeline {k}: log and warnings differ"
            assert all("pipeline_postproc=True" in w for w in run["warnings"]), run["warnings"]


def test_negative_twin_a_fully_pipelined_model_warns_nothing(pool):
    for rank, r in enumerate(pool.run(_pipelines_warn, True, timeout=TIMEOUT)):
        for k, run in enumerate(r["runs"]):
            assert run["not_pipelined"] == [], f"rank {rank}: a module is not pipelined: {run}"
            assert run["warnings"] == [] and run["logged"] == [], f"rank {rank}, pipeline {k}: {run}"


# -- the line the report names --------------------------------------------------------------------


def _report_lines(rank: int, world_size: int, kind: str, how: str) -> dict:
    """The report's line for each call site after 3 steps: the call traced, or recorded from the first
    forward (`method="record"`), on a model from torchrec (its DLRM) or from the tests."""
    model, opt = models.build(kind, "table_wise")
    rewrite = pipeline.RewriteOptions(method=how)
    pipe = pipeline.TrainPipelineSparseDist(model, opt, torch.device("cpu"), rewrite=rewrite)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pipeline.NotPipelinedWarning)
        models.run_to_end(pipe, iter(models.batches(kind, 3, rank)))
    report = pipe.rewrite_report
    return {"sources": [s.source for s in report.sites], "text": str(report)}


@pytest.mark.parametrize("how", ["trace", "record"])
@pytest.mark.parametrize(
    ("kind", "where"), [("dlrm", "torchrec/models/dlrm.py:"), ("postproc", "tests/models.py:")]
)
def test_the_report_names_the_models_line_of_each_call_never_the_pipelines(pool, kind, where, how):
    for rank, r in enumerate(pool.run(_report_lines, kind, how, timeout=TIMEOUT)):
        assert r["sources"], f"rank {rank}: no call site in the report"
        assert all(s is not None and where in s for s in r["sources"]), f"rank {rank}: {r['sources']}"
        assert "pipeline/stages/" not in r["text"] and "pipeline/pipelines/" not in r["text"], r["text"]
