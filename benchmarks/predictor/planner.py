"""torchrec's planner estimators where they fit: the lookup, its backward and the prefetch (cache
fill) of each shard on a GPU (`gpu_lookup`).

torchrec's `EmbeddingPerfEstimator` rates a shard by the bytes it reads and writes over the device's
memory bandwidth (HBM, or host memory for UVM-cached tables), with its kernel penalties, for a
given batch size, pooling factor and world size: a model of GPU kernels, which the cost model has
no measurement of. On a CPU the lookup's cost is dominated by per-id and per-call host work that
those formulas do not have, so `benchmarks.predictor.costs` uses the machine's measured figures there
instead. The estimator's communication figures are not used on either device (they are bandwidth
only: no per-message or per-call cost).

The shards come from torchrec's `EmbeddingEnumerator`, constrained to each table's sharding type
and kernel; the ranks are the workload's (the planner's partitioner is not run: its proposals for
hundreds of ranks take minutes).
"""

from __future__ import annotations

import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.shard_estimators import EmbeddingPerfEstimator
from torchrec.distributed.planner.types import ParameterConstraints, Topology

from benchmarks.predictor.workload import Workload

__all__ = ["gpu_lookup"]


def gpu_lookup(w: Workload) -> tuple[float, float, float]:
    """(forward, backward, prefetch) seconds of the busiest rank's lookups on a GPU, from torchrec's
    planner estimator (module docstring).

    Raises:
        ValueError: a table's sharding type or kernel is one the estimator does not rate.
    """
    topology = Topology(world_size=w.world_size, compute_device="cuda", local_world_size=min(w.world_size, 8))
    configs = [
        EmbeddingBagConfig(
            name=t.name, embedding_dim=t.dim, num_embeddings=t.rows, feature_names=list(t.features)
        )
        for t in w.tables
    ]
    constraints = {
        t.name: ParameterConstraints(
            sharding_types=[t.sharding],
            compute_kernels=[t.kernel],
            pooling_factors=[max(w.feature(f).ids_per_sample, 1e-3) for f in t.features],
        )
        for t in w.tables
    }
    enumerator = EmbeddingEnumerator(
        topology=topology,
        batch_size=w.batch_size,
        constraints=constraints,
        estimator=[EmbeddingPerfEstimator(topology=topology, constraints=constraints)],
    )
    module = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    options = {o.name: o for o in enumerator.enumerate(module, [EmbeddingBagCollectionSharder()])}
    per_rank = [[0.0, 0.0, 0.0] for _ in range(w.world_size)]
    for table in w.tables:
        option = options.get(table.name)
        if option is None:
            raise ValueError(
                f"torchrec's estimator rates no {table.sharding}/{table.kernel} shard of {table.name}"
            )
        for shard, rank in zip(option.shards, _ranks(table, len(option.shards)), strict=True):
            per_rank[rank][0] += shard.perf.fwd_compute
            per_rank[rank][1] += shard.perf.bwd_compute
            per_rank[rank][2] += shard.perf.prefetch_compute
    forward, backward, prefetch = max(per_rank, key=sum)
    return forward / 1e3, backward / 1e3, prefetch / 1e3  # the planner's perf is in milliseconds


def _ranks(table, shards: int) -> list[int]:
    """The rank of each of the enumerator's shards: the workload's, repeated if it has fewer."""
    return [table.ranks[i % len(table.ranks)] for i in range(shards)]
