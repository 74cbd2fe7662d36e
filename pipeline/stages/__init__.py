"""The data path of a batch: copy, input_dist, prefetch and lookup, with their streams, hand-offs and
per-batch contexts. This table is the one description of which stage runs where: in the
`progress()` call that returns batch i, each stage runs on the batch shown.

| stage              | CUDA stream  | Base | SparseDist, Fused, Eval | Prefetch | SemiSync |
|--------------------|--------------|------|-------------------------|----------|----------|
| copy               | memcpy       | i+1  | i+2                     | i+2      | i+3      |
| input_dist::start  | data_dist    | -    | i+1                     | i+1      | i+2      |
| input_dist::splits | data_dist    | -    | i+1                     | i+1      | i+2      |
| input_dist::wait   | its consumer | -    | i (in forward)          | i+1      | i+1      |
| prefetch           | prefetch     | -    | -                       | i+1      | -        |
| lookup             | data_dist    | -    | i (Fused only)          | -        | i+1      |
| forward            | the caller's | i    | i                       | i        | i        |
| backward, optimizer| the caller's | i    | i (not Eval)            | i        | i        |

Profiler labels: `pipeline::<stage>#<batch index>`. input_dist::splits runs before forward of i
under the "early" schedules, after it under "late" (`pipeline.stages.schedule`). Prefetch submits
the prefetch of i+1 after forward of i when ahead, else before forward of i+1, and runs the
SparseDist column where no module's `prefetch()` moves data. Fused's lookup of i may run after the
input_dist start of i+1 (`embedding_lookup_after_data_dist`); SemiSync's lookup of i+1 runs between
forward and backward of i from `start_batch` on, before that after the optimizer step. On CPU there
are no streams: the stages run in this order on the calling thread, the collectives in gloo's.
"""
