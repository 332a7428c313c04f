"""Tooling around the runtime: the demo, the dry run and its enumeration cache, the cost
model, charts, the command-line helpers. The runtime (``megatron_refit`` outside this package
and :mod:`megatron_refit.testing`) imports none of it; ``python -m megatron_refit.demo`` /
``.dryrun`` / ``.costmodel`` are the command-line entry points."""
