"""The data path of a batch: copy, input_dist, prefetch and lookup, with their streams, hand-offs and
per-batch contexts.

This table is the one description of which stage runs where; the classes' docstrings point here.
In the `progress()` call that returns batch i, each stage runs on the batch shown:

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

The stages: copy moves the batch to the device; input_dist::start issues the splits all-to-all (each
rank's number of ids per feature; the KJTs it hands to input_dist carry int32 ids: `narrow`);
input_dist::splits waits for it and issues the values all-to-all; input_dist::wait waits for the
values (inside forward, in the prefetch stage, or in the lookup); prefetch runs `module.prefetch()`
(a cache filled ahead); lookup runs `compute_and_output_dist` (the embedding lookup and its output
all-to-all) ahead of forward. The profiler label of a stage is `pipeline::<stage>#<batch index>`.

Notes on the table:
- input_dist::splits runs before forward of i under the "early" schedules and after it under "late"
  (torchrec's order); `pipeline.stages.schedule` has the four schedules.
- Prefetch: the prefetch of i+1 is submitted after forward of i (`prefetch_ahead`, overlapping
  backward and optimizer), or before forward of i+1; on CPU its stream is a worker thread. When no
  sharded module's `prefetch()` moves data (tables wholly in device memory), the Prefetch pipeline
  runs the SparseDist column instead (`prefetch_mode == "sparse-dist"`).
- Fused: the lookup of i runs first in step i, or after the input_dist start of i+1
  (`embedding_lookup_after_data_dist`); `emb_lookup_stream="current"` runs it on the caller's stream.
- SemiSync: from batch `start_batch` on, the lookup of i+1 runs between forward and backward of i
  (embeddings one step stale); before, after the optimizer step of i.
- Eval has no backward and no optimizer.
- On CPU there are no streams: the stages run in this order on the calling thread, and the
  collectives overlap in gloo's threads.

Its modules, one concept each: docs/architecture.md.
"""
