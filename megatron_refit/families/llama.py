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
        # Published shapes (config.json of meta-llama/Meta-Llama-3-70B), for dry runs only.
        "llama3-70b": dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=8192,
                           intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                           num_key_value_heads=8, head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5,
                           max_position_embeddings=8192, tie_word_embeddings=False),
    },
    **LAYOUT,
)
