"""Megatron-Bridge side of megatron-refit: local HF-named shards of a trainer rank.

Importing this package needs megatron-core and megatron-bridge (see ``te_shim`` for
machines without Transformer Engine).
"""
