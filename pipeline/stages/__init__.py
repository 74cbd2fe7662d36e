"""The data path of a batch: copy, input_dist, prefetch, lookup, with their streams, hand-offs and per-batch contexts."""
