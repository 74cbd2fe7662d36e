"""Predict a pipeline's step before running it: a per-stage cost model and a simulation of each
pipeline class's streams and threads.

`benchmarks.predictor.predict(model, sample_batch, world_size=..., link=...)` (`api.py`) returns, per pipeline
class and input_dist schedule, the predicted step, the stage that bounds it and the memory it keeps
in flight, and the winner. The pieces, one concept a module:

- `workload.py`: the facts of a step (tables, sharding, ids per feature, dense layers), read from a
  DistributedModelParallel and one sample batch, and placed again on another world size;
- `machine.py` and `calibrate.py`: what one operation costs on this machine, measured once by
  micro-benchmarks and cached per machine;
- `dense.py`: the model's own dense forward and backward, timed with its sharded modules stubbed;
- `link.py`: the link (latency per message, bandwidth per rank, or a probed transfer curve);
- `planner.py`: torchrec's planner estimators, for the lookup and prefetch on CUDA;
- `costs.py`: each stage's duration on the busiest rank;
- `simulate.py`: a small discrete-event simulation of tasks on lanes sharing cores and the link;
- `programs.py`: each class's step as tasks (from the stage table of `pipeline.stages`);
- `pin.py`: which input_dist schedule to pin (`input_dist_schedule=...`), agreed across ranks.

Assumptions at large world sizes (docs/benchmarks.md, "Predicting a pipeline's step", has them all):
each rank sends its batch's ids for a table to the rank(s) holding it, so with tables spread evenly
a rank sends (W - 1) / W of its ids and receives as many; an all-to-all costs a fixed host call,
one latency per peer message (W - 1 of them, sent one after the other) and its bytes at the rank's
own bandwidth (no switch contention, no hierarchy); the splits all-to-all is all latency and call;
DDP's ring all-reduce sends 2 (W - 1) / W of the dense gradients' bytes in 2 (W - 1) messages per
bucket; compute per rank does not change with W (same samples per rank) except the lookups, which
follow the busiest rank's shards (table-wise tables placed greedily: at more ranks than tables some
ranks look up nothing and one rank receives W batches' ids of a table).
"""

from benchmarks.predictor.api import PipelineStep, Prediction, predict, predict_workload
from benchmarks.predictor.costs import StageCosts, rank_loads, stage_costs
from benchmarks.predictor.dense import DenseTimes, time_dense
from benchmarks.predictor.link import Link, alltoall_seconds, parse_link, probe_link
from benchmarks.predictor.machine import MachineCosts, cache_path, machine_costs
from benchmarks.predictor.programs import PIPELINES, run_pipeline
from benchmarks.predictor.workload import Workload, workload_of

__all__ = [
    "PIPELINES",
    "DenseTimes",
    "Link",
    "MachineCosts",
    "PipelineStep",
    "Prediction",
    "StageCosts",
    "Workload",
    "alltoall_seconds",
    "cache_path",
    "machine_costs",
    "parse_link",
    "predict",
    "predict_workload",
    "probe_link",
    "rank_loads",
    "run_pipeline",
    "stage_costs",
    "time_dense",
    "workload_of",
]
