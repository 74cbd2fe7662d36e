"""torchrec's public methods of its `TrainPipelineSparseDist` family, over our components, so that a
user's own `progress()` written for torchrec's classes (fill, enqueue, start and wait the sparse
data dist, forward, backward, dequeue) trains here as it does there.

How torchrec's state maps onto ours: torchrec keeps two deques, `batches` and `contexts`; we keep
one deque of contexts per dataloader iterator (a `Lane`), each context holding its batch.
`contexts` is the deque of the lane in use (the iterator last given to `progress`,
`fill_pipeline`, `enqueue_batch` or `copy_batch_to_gpu`) and `batches` a read-only view of its
batches. A batch is admitted by the ranks' protocol before its first collective, as in our own
step. The input all-to-alls are `InputDist.start` and `InputDist.wait_splits`; the hijacked
forwards read the context in the pipeline's slot, which `fill_pipeline` and `dequeue_batch` set to
the head batch's (`_set_module_context`), as torchrec's do.

Our own steps do not call these methods: each class's `_step` calls the components by name, so
the methods cost nothing per step. They run the same stages, in the order the caller chooses.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch import nn

from pipeline.compat.backward_injection import InjectionSite, register_backward_hook
from pipeline.ranks import Lane, Ranks
from pipeline.stages.context import BatchContext
from pipeline.stages.input_dist import InputDist
from pipeline.stages.lookup import LookupStage
from pipeline.stages.streams import Streams, label
from rewrite import unwrap_model

__all__ = ["Batches", "FusedMethods", "SemiSyncMethods", "SparseDistMethods"]


class Batches(Sequence[Any]):
    """torchrec's `batches`: the batches of `contexts`, oldest (the head, batch i) first; a
    placeholder (this rank's data ended, another rank's may not have) is None, as in torchrec. A
    batch whose copy runs on a worker is waited for when read (torchrec's `FutureDeque`)."""

    __slots__ = ("_contexts",)

    def __init__(self, contexts: deque[BatchContext]) -> None:
        self._contexts = contexts

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self._batch(c) for c in list(self._contexts)[i]]
        return self._batch(self._contexts[i])

    @staticmethod
    def _batch(context: BatchContext) -> Any:
        context.wait_copy()
        return context.batch

    def __len__(self) -> int:
        return len(self._contexts)


class SparseDistMethods:
    """torchrec's methods of `TrainPipelineSparseDist` (and of every class derived from it there),
    mixed into `InputDistCore`."""

    _input_dist: InputDist
    _ranks: Ranks
    _execute_all_batches: bool
    _inplace_copy: bool
    _streams: Streams
    _enter: Callable[[Iterator[Any]], Lane]
    _fill: Callable[[Lane], None]
    _fetch_and_copy: Callable[..., BatchContext | None]
    _model: nn.Module

    @property
    def contexts(self) -> deque[BatchContext]:
        """The contexts of the batches in flight, oldest (batch i, the next forward's) first: the
        pipeline's own deque, changed by `enqueue_batch` and `dequeue_batch`."""
        lane = self._ranks.lane
        return lane.inflight if lane is not None else deque()

    @property
    def batches(self) -> Batches:
        """The batches of `contexts` (read-only)."""
        return Batches(self.contexts)

    @property
    def _pipelined_modules(self) -> list[nn.Module]:
        """The sharded modules whose input_dist runs ahead (none before the first batch)."""
        return [pm.module for pm in self._input_dist.modules]

    @property
    def _model_attached(self) -> bool:
        """The sharded modules' forwards are rewritten (False before the first batch and after
        `detach()`; the next batch's input_dist attaches)."""
        return self._input_dist.rewrite is not None

    def fill_pipeline(self, dataloader_iter: Iterator[Any]) -> None:
        """Put in flight what the next step needs (a no-op once full): for SparseDist, batch i
        copied with its input_dist started and its splits waited, and batch i+1 copied. Sets the
        module context to batch i's."""
        lane = self._enter(dataloader_iter)
        self._fill(lane)
        if lane.inflight:
            self._set_module_context(lane.inflight[0])

    def enqueue_batch(self, dataloader_iter: Iterator[Any]) -> bool:
        """Fetch the next batch, copy it to the device and add it, with its context, to
        `batches` and `contexts`.

        Returns:
            Whether a batch was added. Across ranks, a rank whose data ended adds a placeholder
            (None in `batches`) while the ranks agree on where the data ends.

        Raises:
            StopIteration: the data ended and `execute_all_batches` is False (torchrec's rule).
        """
        copy = self.inplace_copy_batch_to_gpu if self._inplace_copy else self.copy_batch_to_gpu
        batch, context = copy(dataloader_iter)  # enters the iterator's lane
        if context is None:
            return False
        self.contexts.append(context)
        return batch is not None

    def dequeue_batch(self) -> None:
        """Remove the head batch (its step is done) and set the module context to the next one's;
        what was handed off for the head batch is released (its backward is queued)."""
        contexts = self.contexts
        self._streams.release(contexts.popleft())
        self._input_dist.slot.current = contexts[0] if contexts else None

    def copy_batch_to_gpu(self, dataloader_iter: Iterator[Any]) -> tuple[Any, BatchContext | None]:
        """Fetch the next batch (`_next_batch`) and copy it to the device, in a new context that
        is not added to `contexts` (`enqueue_batch` adds it).

        Returns:
            `(batch, context)`; batch None when this rank's data ended (context None when nothing
            more is to be added at all).

        Raises:
            StopIteration: the data ended and `execute_all_batches` is False.
        """
        return self._copy(dataloader_iter, in_place=False)

    def inplace_copy_batch_to_gpu(self, dataloader_iter: Iterator[Any]) -> tuple[Any, BatchContext | None]:
        """`copy_batch_to_gpu` with the device copy allocated on the stream that uses it (GPU)."""
        return self._copy(dataloader_iter, in_place=True)

    def _copy(self, dataloader_iter: Iterator[Any], *, in_place: bool) -> tuple[Any, BatchContext | None]:
        context = self._fetch_and_copy(self._enter(dataloader_iter), in_place=in_place)
        batch = context.batch if context is not None else None
        if batch is None and not self._execute_all_batches:
            raise StopIteration
        return batch, context

    def start_sparse_data_dist(self, batch: Any, context: BatchContext) -> None:
        """Start the input all-to-alls of `context`'s batch (their splits), after the ranks
        admitted it; on the first batch, rewrite the sharded modules first. A no-op for a None
        batch, or a batch the ranks dropped (another rank's data ended there).

        Raises:
            ValueError: `batch` is not `context`'s (pass `self.batches[k], self.contexts[k]`).
        """
        lane = self._ranks.lane
        if lane is None or not self._ranks.admit(lane, context) or batch is None:
            return
        if batch is not context.batch:
            raise ValueError(
                "start_sparse_data_dist(batch, context): the input_dist reads the batch of its "
                "context here; pass self.batches[k] with self.contexts[k]"
            )
        self._input_dist.start(context)

    def wait_sparse_data_dist(self, context: BatchContext) -> None:
        """Wait for the splits all-to-alls of `context` and start its values all-to-alls."""
        self._input_dist.wait_splits(context)

    def clear_sparse_data_dist_inputs(self, context: BatchContext) -> None:
        """Wait for the values all-to-alls of `context` and free the tensors they sent (what
        `clear_data_dist_inputs=True` does before each forward)."""
        self._input_dist.clear_inputs(context)

    def _set_module_context(self, context: BatchContext) -> None:
        """Make the hijacked forwards read `context` (the batch whose forward runs next)."""
        self._input_dist.slot.current = context

    def register_backward_hook(self, site: InjectionSite, work: Callable[[Any], None]) -> None:
        """Run `work(self)` during each backward at `site` (ours or torchrec's `InjectionSite`;
        the FQN as the user's model names it, inside DistributedModelParallel), labelled
        `pipeline::backward_hook::<fqn>`. As torchrec's, the hook stays for the pipeline's life."""
        label_text = f"pipeline::backward_hook::{site.fqn}"

        def run(grad: Any) -> None:
            with label(label_text):
                work(self)

        register_backward_hook(site, unwrap_model(self._model), run)


class _LookupMethods:
    _lookup: LookupStage

    def start_embedding_lookup(self, batch: Any, context: BatchContext) -> None:
        """Run the embedding lookup of `context`'s batch (waiting for its input_dist first); its
        output waits for the batch's forward. A no-op for a None batch or once done."""
        if batch is not None:
            self._lookup.run(context)


class FusedMethods(_LookupMethods):
    """torchrec's methods of `TrainPipelineFusedSparseDist`, besides `SparseDistMethods`."""

    def wait_embedding_lookup(self) -> None:
        """Order the caller's stream after the lookups started so far (a no-op without streams)."""
        self._lookup.wait()


class SemiSyncMethods(_LookupMethods):
    """torchrec's methods of `TrainPipelineSemiSync`, besides `SparseDistMethods`."""

    _start_batch: int
    contexts: deque[BatchContext]

    def is_semi_sync(self) -> bool:
        """Whether the head batch is past the warm-up (`start_batch`): its successor's lookup
        runs before its backward."""
        contexts = self.contexts
        return bool(contexts) and contexts[0].index >= self._start_batch

    def embedding_backward(self, context: BatchContext) -> None:
        """Nothing left to do here: the lookup's output is not detached from its autograd graph,
        so `_backward(losses)` already reached the embeddings of `context` (torchrec runs that
        part of backward separately)."""

    def extract_model_input_from_batch(self, batch: Any) -> Any:
        """The batch itself: the input_dist reads the sharded modules' inputs from the batch by
        the paths the rewrite found."""
        return batch
