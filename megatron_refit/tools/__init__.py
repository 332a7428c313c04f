"""Tooling around the runtime: the demo and its harness, spawned-rank launching, the dry run
and its enumeration cache, the cost model, progress bars and charts. The runtime
(``megatron_refit`` outside this package) imports none of it; ``python -m
megatron_refit.demo`` / ``.dryrun`` / ``.costmodel`` are the command-line entry points."""
