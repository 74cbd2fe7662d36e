"""The warning a pipeline gives when a sharded module is not pipelined: on the first batch, once per
module and pipeline, with the reason from the rewrite report and what to do about it.

Such a module still trains correctly: it runs its own forward, input_dist included, so only its
input all-to-alls are not overlapped. The warning goes to the "pipeline" logger (WARNING) and
through `warnings.warn` as a `NotPipelinedWarning`, which a user may filter or make an error
(`warnings.simplefilter("error", NotPipelinedWarning)`); `strict=True` fails instead.
"""

from __future__ import annotations

import logging
import warnings

from rewrite import RewriteReport

__all__ = ["NotPipelinedWarning", "warn_not_pipelined"]

logger = logging.getLogger("pipeline")


class NotPipelinedWarning(UserWarning):
    """A sharded module is not pipelined: it runs its own forward, without overlap."""


def warn_not_pipelined(report: RewriteReport, warned: set[str], *, pipeline_postproc: bool) -> None:
    """Warn about each module of `report` that is not pipelined and not in `warned` (then add it).

    Args:
        report: the rewrite's report.
        warned: the modules this pipeline warned about already.
        pipeline_postproc: the pipeline runs modules that transform the batch ahead (else the
            message suggests it).
    """
    for module in report.not_pipelined:
        if module.fqn in warned:
            continue
        warned.add(module.fqn)
        message = _message(module.fqn, module.reason or "no reason recorded", pipeline_postproc)
        logger.warning(message)
        warnings.warn(message, NotPipelinedWarning, stacklevel=2)


def _message(fqn: str, reason: str, pipeline_postproc: bool) -> str:
    postproc = (
        ""
        if pipeline_postproc
        else "; pipeline_postproc=True, if its input comes out of a parameter-free module that "
        "transforms the batch"
    )
    return (
        f"sharded module {fqn!r} is not pipelined: {reason}. It runs its own forward, so its input "
        f"all-to-alls do not overlap the previous batch (training is unchanged). To pipeline it, "
        f"pass arg_paths={{{fqn!r}: <path of its input in the batch>}}{postproc}; or strict=True "
        "to make this an error."
    )
