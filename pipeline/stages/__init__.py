"""The data path of a batch: copy, input_dist, prefetch and lookup, with their streams, hand-offs and
per-batch contexts."""
