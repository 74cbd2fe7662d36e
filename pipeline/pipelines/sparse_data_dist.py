"""`SparseDataDistUtil`: the input_dist stage of a `StagedTrainPipeline`, and optionally a prefetch
stage or an embedding lookup stage after it, handing their results to the caller's forward
(docs/reference.md, "StagedTrainPipeline").

With stages [..., input_dist, X] the pipeline runs, in the `progress()` call that returns batch i,
input_dist::start on batch i+2 and X on batch i+1 (without X: input_dist::start on i+1). A forward
pre-hook on the model gives the oldest started batch to the hijacked forwards (waiting for its
prefetch stage); a forward hook, once forward of i is done, waits for the splits of the batches
started since (launching their values all-to-alls), as in torchrec's ("late") order. X is the
prefetch (`prefetch_stream`: each module's `prefetch()`; the plain loop's numbers) or the lookup
(`embedding_lookup_stream`: `compute_and_output_dist`, before backward of i, whose fused update batch
i+1 then does not see: embeddings one step stale, torchrec's semi-synchronous staged pipeline).
"""

from __future__ import annotations

import enum
import sys
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pipeline.compat.arguments import refuse_jit
from pipeline.config import InputDistOptions, PrefetchOptions, RewriteOptions, resolve
from pipeline.pipelines.staged import PipelineStage, util_streams
from pipeline.stages.context import BatchContext, LookupBatchContext, PrefetchBatchContext
from pipeline.stages.input_dist import InputDist
from pipeline.stages.lookup import LookupStage
from pipeline.stages.prefetch import PrefetchStage
from pipeline.stages.streams import Streams

__all__ = ["SparseDataDistUtil"]


class _Extra(enum.Enum):
    """The stage after input_dist, if any."""

    NONE = "input_dist"
    PREFETCH = "prefetch"
    LOOKUP = "lookup"


_CONTEXTS = {
    _Extra.NONE: BatchContext,
    _Extra.PREFETCH: PrefetchBatchContext,
    _Extra.LOOKUP: LookupBatchContext,
}


class SparseDataDistUtil:
    """Makes the input_dist stage of a `StagedTrainPipeline` (and a prefetch or lookup stage after
    it) and hands their results to forward.

    Args (torchrec's, in its order):
        model: the sharded model the caller runs on each batch `progress()` returns.
        data_dist_stream: the CUDA stream of the input all-to-alls; None (or a CPU stream) on CPU.
        apply_jit: not supported; must be False.
        prefetch_stream: given (any stream, a CPU one on CPU): `prefetch` is a stage, to be placed
            right after the input_dist stage. Same numerics.
        pipeline_postproc: run parameter-free modules that transform the batch ahead.
        embedding_lookup_stream: given: `start_embedding_lookup_stage()` is a stage, to be placed
            right after the input_dist stage; embeddings are then one step stale (see the module).
            Not together with `prefetch_stream`.

    Keyword-only, ours:
        strict: fail on the first batch if a sharded module cannot be pipelined.
        rewrite_method, arg_paths: the fields of `RewriteOptions` (`rewrite` may give them).
        narrow_ids: `InputDistOptions.narrow_ids` (None: its default, True).
        streams: the hand-offs of the stages' results to forward's stream (tests pass
            `tests.streamcheck.RecordingStreams()`, with its `data_dist` as `data_dist_stream`); None: CUDA
            hand-offs if `data_dist_stream` is a CUDA stream.

    What forward took of a batch is released at the next forward, or at `detach()`: the caller's
    backward of that batch is queued by then.

    Raises:
        ValueError: both `prefetch_stream` and `embedding_lookup_stream`, or `apply_jit`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        data_dist_stream: Any = None,
        apply_jit: bool = False,
        prefetch_stream: Any = None,
        pipeline_postproc: bool = False,
        embedding_lookup_stream: Any = None,
        *,
        strict: bool = False,
        rewrite: RewriteOptions | None = None,
        rewrite_method: str | None = None,
        arg_paths: dict[str, Any] | None = None,
        narrow_ids: bool | None = None,
        streams: Streams | None = None,
    ) -> None:
        refuse_jit(apply_jit)
        if prefetch_stream is not None and embedding_lookup_stream is not None:
            raise ValueError(
                "SparseDataDistUtil: pass prefetch_stream or embedding_lookup_stream, not both "
                "(the lookup stage already waits for input_dist; a prefetch before it adds nothing)"
            )
        self._extra = (
            _Extra.PREFETCH
            if prefetch_stream is not None
            else _Extra.LOOKUP
            if embedding_lookup_stream is not None
            else _Extra.NONE
        )
        self.model = model
        self.data_dist_stream = data_dist_stream
        self.prefetch_stream = prefetch_stream
        self.embedding_lookup_stream = embedding_lookup_stream
        self._streams = streams = util_streams(data_dist_stream, prefetch_stream, streams)
        # the staged pipeline runs the prefetch stage on its own stream; forward runs on the caller's
        self._forward_stream = streams.current()
        # torchrec's order ("late" schedule, torchrec's process group); no votes: the stages fetch
        self._input_dist = InputDist(
            model,
            streams,
            rewrite=resolve(rewrite, RewriteOptions, method=rewrite_method, arg_paths=arg_paths),
            strict=strict,
            pipeline_postproc=pipeline_postproc,
            schedule=resolve(InputDistOptions(schedule="late"), InputDistOptions, narrow_ids=narrow_ids),
            forward=self._extra.value,
        )
        self._prefetch = (
            PrefetchStage(streams, self._input_dist, ahead=PrefetchOptions().prefetch_ahead)
            if self._extra is _Extra.PREFETCH
            else None
        )
        # the staged pipeline makes the stage's stream current: the lookup runs on the caller's
        self._lookup = (
            LookupStage(streams, self._input_dist, model, None, on_caller_stream=True)
            if self._extra is _Extra.LOOKUP
            else None
        )
        self._contexts: deque[BatchContext] = deque()
        """Batches whose input_dist started, oldest (the next forward's) first."""
        self._awaiting_stage: deque[BatchContext] = deque()
        """Batches whose input_dist started and whose prefetch or lookup stage has not run."""
        self._forwarded: list[BatchContext] = []
        """Batches whose forward ran, released at the next forward (their backward is queued)."""
        self._hooks: list[Any] = []
        self._next_index = 0
        self._recording: Any = None
        """The recording context of the forward that runs (a no-op once the rewrite is complete)."""

    @property
    def rewrite_report(self) -> Any:
        return self._input_dist.report

    def start_sparse_data_dist(self, batch: Any) -> Any:
        """The stage: start the input all-to-alls of `batch`; returns `batch` unchanged."""
        ctx = _CONTEXTS[self._extra](index=self._next_index, streams=self._streams, batch=batch)
        self._next_index += 1
        self._input_dist.start(ctx)
        if not self._hooks:
            self._hooks = [
                self.model.register_forward_pre_hook(self._before_forward),
                # always: a forward that raised must still end a recording (it patches torchrec)
                self.model.register_forward_hook(self._after_forward, always_call=True),
            ]
        self._contexts.append(ctx)
        if self._extra is not _Extra.NONE:
            self._awaiting_stage.append(ctx)
        return batch

    def wait_sparse_data_dist(self) -> None:
        """Wait for the splits of every started batch (launching their values all-to-alls)."""
        for ctx in self._contexts:
            self._input_dist.wait_splits(ctx)  # a no-op once done

    def wait_sdd_fill_callback(self) -> None:
        """While filling (no forward runs), wait for the splits of the batch just started."""
        if self._contexts:
            self._input_dist.wait_splits(self._contexts[-1])

    def data_exhausted_callback(self) -> None:
        """Nothing to do: the hooks stop finding batches once the last one is consumed."""

    def prefetch(self, batch: Any) -> Any:
        """The prefetch stage: wait for `batch`'s input_dist, then each module's `prefetch()` (on
        the prefetch stream: a worker thread on CPU); returns `batch` unchanged."""
        ctx = self._stage_context(batch, _Extra.PREFETCH, "prefetch")
        if ctx.started:  # else the forward that is recorded starts it, and its prefetch
            self._input_dist.wait_splits(ctx)
            self._prefetch.submit(ctx, self._forward_stream)
        return batch

    def load_prefetch(self) -> None:
        """torchrec's fill callback of the prefetch stage, kept for its users; nothing to do."""

    def start_embedding_lookup(self, batch: Any) -> Any:
        """The lookup stage: wait for `batch`'s input_dist, then look its embeddings up and start
        their all-to-all (read by its forward); returns `batch` unchanged."""
        ctx = self._stage_context(batch, _Extra.LOOKUP, "start_embedding_lookup")
        self._lookup.run(ctx)
        return batch

    def _stage_context(self, batch: Any, extra: _Extra, name: str) -> BatchContext:
        """The context of `batch`, the oldest started batch whose prefetch/lookup stage has not run."""
        if self._extra is not extra:
            arg = "prefetch_stream" if extra is _Extra.PREFETCH else "embedding_lookup_stream"
            raise ValueError(f"SparseDataDistUtil.{name} is a stage only when {arg} is given")
        if not self._awaiting_stage or self._awaiting_stage[0].batch is not batch:
            raise ValueError(
                f"SparseDataDistUtil.{name} got a batch whose input_dist it did not start: place its "
                "stage right after start_sparse_data_dist_stage(), with no stage between that "
                "returns another object"
            )
        return self._awaiting_stage.popleft()

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        self._release_forwarded()
        ctx = self._contexts[0] if self._contexts else None
        if ctx is not None and not ctx.started:  # it waited for the recorded forward to start
            self._input_dist.start(ctx)
            self._input_dist.wait_splits(ctx)
            if self._lookup is not None:
                self._lookup.run(ctx)
        if ctx is not None and self._awaiting_stage and self._awaiting_stage[0] is ctx:
            raise RuntimeError(
                f"SparseDataDistUtil was given a {self._extra.value} stream, but the {self._extra.value} "
                "stage did not run for this batch: put it in the StagedTrainPipeline's stages, right "
                "after start_sparse_data_dist_stage()"
            )
        if ctx is not None and self._prefetch is not None:
            self._prefetch.wait(ctx)
        self._input_dist.slot.current = ctx
        self._recording = self._input_dist.recording(ctx) if ctx is not None else None
        if self._recording is not None:
            self._recording.__enter__()

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self._input_dist.slot.current = None
        recording, self._recording = self._recording, None
        if recording is not None:
            recording.__exit__(*sys.exc_info())  # raising inside forward: the exception, else Nones
        elif sys.exc_info()[0] is None:
            self._input_dist.slot.check_calls()
        if self._contexts:
            self._forwarded.append(self._contexts.popleft())
        self.wait_sparse_data_dist()  # the values all-to-alls run during backward

    def detach(self) -> nn.Module:
        """Restore the model's own forwards; the next started batch re-attaches. Batches whose
        input_dist started are kept."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._release_forwarded()
        self._streams.wait_all()
        self._input_dist.detach()
        return self.model

    def _release_forwarded(self) -> None:
        while self._forwarded:
            self._streams.release(self._forwarded.pop())

    def start_sparse_data_dist_stage(
        self, name: str = "start_sparse_data_dist", runnable: Callable[[Any], Any] | None = None
    ) -> PipelineStage:
        """The `PipelineStage` that starts input_dist (the last stage, or the one before the
        prefetch or lookup stage)."""
        return PipelineStage(
            name=name,
            runnable=runnable or self.start_sparse_data_dist,
            stream=self.data_dist_stream,
            fill_callback=self.wait_sdd_fill_callback,
            data_exhausted_callback=self.data_exhausted_callback,
        )

    def start_embedding_lookup_stage(
        self, name: str = "start_embedding_lookup", runnable: Callable[[Any], Any] | None = None
    ) -> PipelineStage:
        """The `PipelineStage` of the embedding lookup (the last stage, right after input_dist's).

        Raises:
            ValueError: no `embedding_lookup_stream` was given.
        """
        if self.embedding_lookup_stream is None:
            raise ValueError(
                "start_embedding_lookup_stage() needs SparseDataDistUtil(..., embedding_lookup_stream=...)"
                " (on CPU any stream, e.g. torch.Stream('cpu'))"
            )
        return PipelineStage(
            name=name, runnable=runnable or self.start_embedding_lookup, stream=self.embedding_lookup_stream
        )
