"""Llama 3 (no QK norm; untied and tied embeddings): Bridge's local layer spec builds it."""

from __future__ import annotations

from megatron_refit.families.base import ModelFamily
from megatron_refit.families.hf_decoder import LAYOUT, TINY

FAMILY = ModelFamily(
    name="llama",
    architectures={"LlamaForCausalLM": "LlamaConfig"},
    demo=("llama3", "llama3-tied"),
    presets={
        "llama3": dict(TINY, architectures=["LlamaForCausalLM"], rope_theta=500000.0),
        "llama3-tied": dict(TINY, architectures=["LlamaForCausalLM"], rope_theta=500000.0, tie_word_embeddings=True),
    },
    **LAYOUT,
)
