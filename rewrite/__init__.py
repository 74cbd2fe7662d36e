"""Forward hijacking for sharded TorchRec models.

`rewrite_model` finds, for each call of each sharded module in forward, how its input comes out of
the batch (an ArgInfo: a small program of pure steps, found from an explicit path or function, the
fx trace, direct lookup, or a recorded first forward), replaces its forward with one that consumes
what the pipeline prepared, and returns a `Rewrite` whose `restore()` puts the model back exactly. This
package knows nothing of streams or pipelines; the forwards read the context interface defined in
`rewrite.forwards`.
"""

from rewrite.arginfo import (
    ArgInfo,
    Attr,
    Build,
    Call,
    CallArgs,
    Const,
    Item,
    Pack,
    PathError,
    PostprocCall,
    parse_path,
)
from rewrite.direct import find_kjts
from rewrite.forwards import (
    CallCountError,
    ContextSlot,
    ForwardContext,
    LookupPipelinedForward,
    NotPreparedError,
    PipelinedForward,
    PostprocForward,
    PrefetchPipelinedForward,
    site_key,
)
from rewrite.model import Rewrite, outermost_sharded, rewrite_model, unwrap_model
from rewrite.ops import CONSTRUCTORS, METHODS
from rewrite.record import record_calls
from rewrite.replay import (
    fuse_splits_requests,
    input_dists_ready,
    install_fused_splits,
    kjt_all_to_alls,
    one_by_one,
)
from rewrite.report import ModuleReport, RewriteError, RewriteReport, SiteReport
from rewrite.sites import CallSite, ExplicitInput, PipelinedModule, SiteInput
from rewrite.trace import Tracer, trace_call_sites

__all__ = [
    "CONSTRUCTORS",
    "METHODS",
    "ArgInfo",
    "Attr",
    "Build",
    "Call",
    "CallArgs",
    "CallCountError",
    "CallSite",
    "Const",
    "ContextSlot",
    "ExplicitInput",
    "ForwardContext",
    "Item",
    "LookupPipelinedForward",
    "ModuleReport",
    "NotPreparedError",
    "Pack",
    "PathError",
    "PipelinedForward",
    "PipelinedModule",
    "PostprocCall",
    "PostprocForward",
    "PrefetchPipelinedForward",
    "Rewrite",
    "RewriteError",
    "RewriteReport",
    "SiteInput",
    "SiteReport",
    "Tracer",
    "find_kjts",
    "fuse_splits_requests",
    "input_dists_ready",
    "install_fused_splits",
    "kjt_all_to_alls",
    "one_by_one",
    "outermost_sharded",
    "parse_path",
    "record_calls",
    "rewrite_model",
    "site_key",
    "trace_call_sites",
    "unwrap_model",
]
