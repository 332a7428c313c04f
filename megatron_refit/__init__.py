"""megatron-refit: shard-to-shard weight refit from Megatron-Core trainers to inference engines.

The sub-packages are the layers, each importing only those below it (docs/architecture.md):
``plan`` (torch-free: boxes, layouts, sender assignment, buckets), ``config``, ``transport``,
``endpoint`` (one rank's side of a refit), ``refit`` (the public entry points), ``engines``
(vLLM, SGLang, Hugging Face; each in its own folder), ``tools`` (never imported by the rest).
This package never imports Megatron: generation workers import it in their own environment.
The Megatron-Bridge side lives in the top-level ``conversion`` package.
"""

__version__ = "0.1.0"
