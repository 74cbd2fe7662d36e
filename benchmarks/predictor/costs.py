"""The per-stage cost model: how long each stage of one batch takes on the busiest rank
(`StageCosts`), from a `Workload`, the machine's `MachineCosts`, a `Link` and the dense part's
measured `DenseTimes`.

Loads per rank (`rank_loads`): a feature's ids go to every shard of its table (table-wise: one rank;
column-wise: each column shard's rank; row-wise: each id to the one rank holding its row, so an
even share to each). A rank looks up what it receives, and sends back one pooled row per sample and
shard (one row per id for an EmbeddingCollection); a row-wise shard sends its partial sums for every
sample of every rank. Every collective takes as long as its busiest rank (sending or receiving,
whichever is more: the link is full duplex), so each figure is the maximum over ranks.

Where each number comes from: measured on this machine once (`MachineCosts`: the lookup, the
collectives' host work and round trips at two ranks, the optimizer, the KJT check, the step's
overhead); measured on the model (`benchmarks.predictor.dense.time_dense`: its dense forward and
backward, else the micro-benchmarks' per-operation and per-FLOP costs); the link (`Link`); and on
CUDA only torchrec's planner estimator for the lookup and the cache fill (`benchmarks.predictor.planner`
says why only there).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from benchmarks.predictor.dense import DenseTimes
from benchmarks.predictor.link import Link
from benchmarks.predictor.machine import CollectiveCost, MachineCosts
from benchmarks.predictor.workload import Workload

__all__ = ["Collective", "RankLoad", "StageCosts", "rank_loads", "stage_costs", "step_overhead"]

_FLOAT = 4
_FIRST_BUCKET, _BUCKET = 1 << 20, 25 << 20  # DDP's gradient buckets


@dataclass(frozen=True, kw_only=True, slots=True)
class Collective:
    """One collective on one rank: host work on the thread that waits for it, a latency (round
    trips), then a transfer that holds the link (and a share of a core for the copies).

    A round trip holds a core (`latency_cpu` 1): both ranks' gloo threads must run to answer, on
    cores the compute threads keep busy. That is what the sweep measured: where the collectives
    are small (lo-tiny, 1g-tiny in docs/benchmarks.md) no pipeline hides them, the step is compute
    plus communication; with a core to spare per rank they overlap."""

    host: float
    latency: float
    wire: float
    latency_cpu: float = 0.0
    nbytes: float = 0.0


def _collective(
    fixed: CollectiveCost, link: Link, loopback: Link, *, peers: int, nbytes: float, messages: float = 1.0
) -> Collective:
    """A collective of `nbytes` leaving the rank, from its two-rank fixed cost on this machine: its
    latency per peer message with the loopback's own latency replaced by the link's."""
    if peers == 0:
        return Collective(host=fixed.host, latency=0.0, wire=0.0)
    per_message = max(fixed.latency - loopback.latency, 0.0) + link.latency
    latency = messages * peers * per_message
    wire = max(link.transfer(nbytes) - link.transfer(0.0), 0.0) if nbytes > 0 else 0.0
    return Collective(host=fixed.host, latency=latency, wire=wire, latency_cpu=1.0, nbytes=nbytes)


@dataclass(frozen=True, kw_only=True, slots=True)
class RankLoad:
    """One rank's share of one batch."""

    local_ids: float
    """Ids of this rank's own batch."""
    lookup_ids: float
    lookup_elems: float
    """Ids this rank looks up, and ids times the columns of their shards."""
    lookup_tables: int
    values_out: float
    values_in: float
    """Bytes of ids and lengths this rank sends to, and receives from, its peers."""
    pooled_out: float
    pooled_in: float
    """Bytes of looked-up embeddings sent to, and received from, peers (forward; backward the
    reverse)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StageCosts:
    """Seconds of each stage of one batch on the busiest rank (collectives as `Collective`)."""

    copy: float
    """Host: the copy stage (on CUDA the issue only) and the KJT check of the batch."""
    copy_device: float
    """The host-to-device transfer on the memcpy stream (0 on CPU: batches are not copied; on CUDA
    the batch's bytes at an assumed 20 GB/s, a PCIe 4 link)."""
    start: float
    """Host: input_dist::start (torchrec's per-module work, grouping ids by destination)."""
    splits: Collective
    splits_host: float
    """Host: input_dist::splits (waiting for the splits, issuing the values all-to-all)."""
    values: Collective
    wait: float
    """Host: input_dist::wait's assembly (received ids put back in feature order)."""
    prefetch: float
    """`module.prefetch()` work (0 for kernels without a cache to fill)."""
    lookup_fwd: float
    lookup_bwd: float
    output_fwd: Collective
    output_bwd: Collective
    dense_fwd: float
    dense_bwd: float
    allreduce: Collective
    optimizer: float
    overhead: float
    """Host, per step: what a step costs beyond its stages measured one by one (`step_overhead`)."""
    cpu_share: float
    """Fraction of a core a transfer at full rate keeps busy (`Link.cpu_share`)."""
    batch_bytes: float
    values_bytes: float
    pooled_bytes: float
    """Bytes one input batch, its received ids and its pooled embeddings hold (memory in flight)."""


def rank_loads(w: Workload) -> list[RankLoad]:
    """Each rank's share of one batch (module docstring)."""
    world, batch = w.world_size, w.batch_size
    per_id = w.id_bytes
    loads = [
        dict.fromkeys(("local", "ids", "elems", "vout", "vin", "pout", "pin"), 0.0) for _ in range(world)
    ]
    tables = [set() for _ in range(world)]
    for load in loads:
        load["local"] = batch * sum(f.ids_per_sample for f in w.features)
    for t in w.tables:
        for name in t.features:
            f = w.feature(name)
            ids = batch * f.ids_per_sample
            nbytes = ids * (per_id + (_FLOAT if f.weighted else 0))
            row_wise = t.sharding in ("row_wise", "table_row_wise")
            share = 1.0 / len(t.ranks) if row_wise else 1.0
            for rank, dim in zip(t.ranks, t.shard_dims, strict=True):
                tables[rank].add(t.name)
                out_rows = ids if not t.pooled else batch  # rows one source rank gets back
                got = ids * share
                loads[rank]["ids"] += world * got
                loads[rank]["elems"] += world * got * dim
                for src in range(world):
                    if src == rank:
                        continue
                    sent = nbytes * share + batch * w.length_bytes
                    loads[src]["vout"] += sent
                    loads[rank]["vin"] += sent
                    back = (out_rows * share if not t.pooled else out_rows) * dim * _FLOAT
                    loads[rank]["pout"] += back
                    loads[src]["pin"] += back
    return [
        RankLoad(
            local_ids=x["local"],
            lookup_ids=x["ids"],
            lookup_elems=x["elems"],
            lookup_tables=len(tables[r]),
            values_out=x["vout"],
            values_in=x["vin"],
            pooled_out=x["pout"],
            pooled_in=x["pin"],
        )
        for r, x in enumerate(loads)
    ]


def stage_costs(
    w: Workload,
    m: MachineCosts,
    link: Link,
    *,
    dense: DenseTimes | None = None,
    gpu_lookup: tuple[float, float, float] | None = None,
) -> StageCosts:
    """The `StageCosts` of `w` on this machine over `link`.

    Args:
        dense: the model's measured dense forward and backward (else the micro-benchmarks').
        gpu_lookup: (forward, backward, prefetch) seconds of the busiest rank's lookups from
            torchrec's planner (CUDA); None uses the measured CPU costs.
    """
    loads = rank_loads(w)
    busiest = max(loads, key=lambda x: x.lookup_elems + x.lookup_ids)
    peers = w.world_size - 1
    modules = max(w.sharded_modules, 1)
    values = max(max(x.values_out, x.values_in) for x in loads)
    pooled = max(max(x.pooled_out, x.pooled_in) for x in loads)
    lookup_fwd = m.lookup_fwd_call * modules + m.lookup_fwd_table * busiest.lookup_tables
    lookup_fwd += m.lookup_fwd_id * busiest.lookup_ids + m.lookup_fwd_elem * busiest.lookup_elems
    lookup_bwd = m.lookup_bwd_call * modules + m.lookup_bwd_table * busiest.lookup_tables
    lookup_bwd += m.lookup_bwd_id * busiest.lookup_ids + m.lookup_bwd_elem * busiest.lookup_elems
    prefetch = 0.0
    if gpu_lookup is not None:
        lookup_fwd, lookup_bwd, prefetch = gpu_lookup
    dense = dense or _dense_fallback(w, m)
    local = loads[0].local_ids
    received = max(x.lookup_ids for x in loads)

    def collective(fixed: CollectiveCost, nbytes: float, *, host: bool = True) -> Collective:
        c = _collective(fixed, link, m.loopback, peers=peers, nbytes=nbytes)
        return Collective(
            host=c.host * modules if host else 0.0,
            latency=c.latency,
            wire=c.wire,
            latency_cpu=c.latency_cpu,
            nbytes=nbytes,
        )

    if peers == 0:  # one rank: torchrec's input_dist and output are local, nothing waits
        start = modules * (m.input_dist_call + m.permute_call) + m.permute_id * local
        splits_host, wait = 0.0, modules * m.permute_call + m.permute_id * received
        output = Collective(host=modules * m.output_call, latency=0.0, wire=0.0)
    else:  # the host parts are each stage's own (the collectives are waited for by the next)
        extra = max(len(w.features) - 2 * modules, 0)  # features beyond the measured module's two
        pooled_elems = max(x.pooled_out for x in loads) / _FLOAT * w.world_size / peers  # self included

        def host(c: CollectiveCost, units: float) -> float:
            return modules * c.host + extra * c.host_feature + units * c.host_unit

        start = host(m.start, local)
        splits_host = host(m.splits, local)
        wait = host(m.values, received)
        output = dataclasses.replace(
            collective(m.output, pooled, host=False), host=host(m.output, pooled_elems)
        )
    return StageCosts(
        copy=m.kjt_check_id * local,
        copy_device=w.batch_bytes / 20e9 if w.device == "cuda" else 0.0,
        start=start,
        splits=collective(m.splits, 0.0, host=False),
        splits_host=splits_host,
        values=collective(m.values, values, host=False),
        wait=wait,
        prefetch=prefetch,
        lookup_fwd=lookup_fwd,
        lookup_bwd=lookup_bwd,
        output_fwd=output,
        output_bwd=output,
        dense_fwd=dense.forward,
        dense_bwd=dense.backward,
        allreduce=_allreduce(w, m, link),
        optimizer=m.optimizer_tensor * w.dense_tensors + m.optimizer_param * w.dense_params,
        overhead=step_overhead(m, w.world_size),
        cpu_share=link.cpu_share(),
        batch_bytes=float(w.batch_bytes),
        values_bytes=max(x.values_in for x in loads),
        pooled_bytes=w.batch_size * sum(t.dim for t in w.tables for _ in t.features) * _FLOAT,
    )


def step_overhead(m: MachineCosts, world_size: int) -> float:
    """What a training step costs beyond its stages measured one by one (DistributedModelParallel's
    and DDP's wrappers and hooks, autograd's setup; at several ranks the ranks' lockstep): the
    smallest sharded model's step (two tables of 4 columns, 8 samples, one linear layer), less its
    dense part, lookups and optimizer, and less its input_dist and pooled all-to-alls (at one rank
    their host work, at two the collectives as measured one by one)."""
    ids, elems = 16.0, 64.0
    compute = m.tiny_dense + m.optimizer_tensor * 2 + m.optimizer_param * 40
    compute += m.lookup_fwd_call + 2 * m.lookup_fwd_table + m.lookup_fwd_id * ids + m.lookup_fwd_elem * elems
    compute += m.lookup_bwd_call + 2 * m.lookup_bwd_table + m.lookup_bwd_id * ids + m.lookup_bwd_elem * elems
    if world_size == 1:
        stages = m.input_dist_call + 3 * m.permute_call + 2 * m.output_call
        return max(m.tiny_step_one_rank - compute - stages, 0.0)
    stages = sum(c.host + c.latency for c in (m.start, m.splits, m.values, m.allreduce))
    stages += 2 * (m.output.host + m.output.latency)
    return max(m.tiny_step_two_ranks - compute - stages, 0.0)


def _dense_fallback(w: Workload, m: MachineCosts) -> DenseTimes:
    flops = sum(2.0 * w.batch_size * layer.fan_in * layer.fan_out for layer in w.dense_layers)
    ops = max(w.dense_ops, 2 * len(w.dense_layers) + 1)
    total = ops * m.dense_op + 3 * flops * m.dense_flop
    return DenseTimes(forward=total / 3, backward=2 * total / 3)


def _allreduce(w: Workload, m: MachineCosts, link: Link) -> Collective:
    """DDP's gradient all-reduce (gloo's ring): 2 (W - 1) / W of the bytes leave each rank, in
    2 (W - 1) messages per bucket (the two-rank measurement has 2)."""
    world = w.world_size
    nbytes = w.dense_params * _FLOAT
    if world == 1 or nbytes == 0:
        return Collective(host=0.0, latency=0.0, wire=0.0)
    buckets = 1 + max(0, math.ceil((nbytes - _FIRST_BUCKET) / _BUCKET))
    c = _collective(
        m.allreduce,
        link,
        m.loopback,
        peers=world - 1,
        nbytes=2 * (world - 1) / world * nbytes,
        messages=buckets,
    )
    return Collective(
        host=c.host * buckets, latency=c.latency, wire=c.wire, latency_cpu=c.latency_cpu, nbytes=nbytes
    )
