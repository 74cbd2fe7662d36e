"""Step-time, CPU and memory benchmarks: the plain loop, this library's pipelines and torchrec's own.

`python -m benchmarks <what>` (`benchmarks/__main__.py` lists the subcommands); docs/benchmarks.md
explains the figures. Nothing here reaches into the library: it uses the public names of `pipeline`,
`tiered` and torchrec, the profiler labels the pipeline emits, and the process's clocks and /proc.
"""
