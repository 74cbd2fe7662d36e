"""Step-time and memory benchmarks: the plain loop, this library's pipelines and torchrec's own.

`python -m benchmarks.run` (or `make bench`) trains small sharded DLRMs on 2 local ranks with every
variant, from identically built models on the same pre-generated batches, and writes a table, a JSON
file and a Markdown summary. `--link RATE` puts each rank in its own network namespace behind a
rate-limited veth pair (see `benchmarks.link`). docs/benchmarks.md explains the figures.
"""
