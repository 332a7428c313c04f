"""megatron-refit: shard-to-shard weight refit from Megatron-Core trainers to inference engines.

This package never imports Megatron: generation workers import it in their own environment.
The Megatron-Bridge side lives in the top-level ``conversion`` package.
"""

__version__ = "0.1.0"
