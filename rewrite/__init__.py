"""Forward hijacking for sharded TorchRec models.

`rewrite_model` finds, for each sharded module, how its input comes out of the batch (an ArgInfo:
explicit path, fx trace, or direct lookup), replaces its forward with one that consumes what the
pipeline prepared, and returns a `Rewrite` whose `restore()` puts the model back exactly. This
package knows nothing of streams or pipelines; the forwards read the context interface defined in
`rewrite.forwards`.
"""

from rewrite.arginfo import (
    ArgInfo,
    Attr,
    CallArgs,
    Const,
    Item,
    PathError,
    PostprocCall,
    parse_path,
)
from rewrite.direct import find_kjts
from rewrite.forwards import (
    ContextSlot,
    ForwardContext,
    LookupPipelinedForward,
    NotPreparedError,
    PipelinedForward,
    PostprocForward,
    PrefetchPipelinedForward,
)
from rewrite.model import PipelinedModule, Rewrite, outermost_sharded, rewrite_model, unwrap_model
from rewrite.report import ModuleReport, RewriteError, RewriteReport
from rewrite.splits import (
    fuse_splits_requests,
    input_dists_ready,
    install_fused_splits,
    kjt_all_to_alls,
    one_by_one,
)
from rewrite.trace import Tracer

__all__ = [
    "ArgInfo",
    "Attr",
    "CallArgs",
    "Const",
    "ContextSlot",
    "ForwardContext",
    "Item",
    "LookupPipelinedForward",
    "ModuleReport",
    "NotPreparedError",
    "PathError",
    "PipelinedForward",
    "PipelinedModule",
    "PostprocCall",
    "PostprocForward",
    "PrefetchPipelinedForward",
    "Rewrite",
    "RewriteError",
    "RewriteReport",
    "Tracer",
    "find_kjts",
    "fuse_splits_requests",
    "input_dists_ready",
    "install_fused_splits",
    "kjt_all_to_alls",
    "one_by_one",
    "outermost_sharded",
    "parse_path",
    "rewrite_model",
    "unwrap_model",
]
