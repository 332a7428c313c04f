"""Megatron-Bridge side of megatron-refit: everything that imports Megatron.

The runtime: a trainer rank's HF-named local shards (``local_shards``, ``lora``, ``te_fp8``),
``refit.trainer_refit``, the training callback (``refit_callback``), the audited adapter for
Bridge's private names (``bridge_api``) and the shims that import Megatron without CUDA
(``te_shim``, ``mamba_shim``, ``cpu_shim``). ``conversion.testing`` holds the tiny-model
builders for tests, the demo and the dry run; the runtime never imports it.

Importing this package needs megatron-core and megatron-bridge (see ``te_shim`` for
machines without Transformer Engine).
"""
