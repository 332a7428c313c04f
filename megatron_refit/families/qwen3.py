"""Qwen3 (dense) and Qwen3-MoE: Bridge's local layer spec builds them as they are."""

from __future__ import annotations

from megatron_refit.families.base import ModelFamily
from megatron_refit.families.hf_decoder import LAYOUT, TINY

_MOE = dict(decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)

FAMILY = ModelFamily(
    name="qwen3",
    architectures={"Qwen3ForCausalLM": "Qwen3Config", "Qwen3MoeForCausalLM": "Qwen3MoeConfig"},
    demo=("qwen3", "qwen3-moe"),
    presets={
        "qwen3": dict(TINY, architectures=["Qwen3ForCausalLM"]),
        "qwen3-moe": dict(TINY, architectures=["Qwen3MoeForCausalLM"], moe_intermediate_size=32, num_experts=4,
                          num_experts_per_tok=2, **_MOE),
        # Published shapes (config.json of Qwen/Qwen3-30B-A3B), for meta enumeration only.
        "qwen3-30b-a3b": dict(
            architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048, intermediate_size=6144,
            moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
            head_dim=128, num_experts=128, num_experts_per_tok=8, tie_word_embeddings=False, **_MOE,
            max_position_embeddings=40960,
        ),
        # Published shapes (config.json of Qwen/Qwen3-4B): dense, tied embeddings.
        "qwen3-4b": dict(
            architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=2560, intermediate_size=9728,
            num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
            tie_word_embeddings=True, max_position_embeddings=40960,
        ),
        # Published shapes (config.json of Qwen/Qwen3-235B-A22B).
        "qwen3-235b-a22b": dict(
            architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=4096, intermediate_size=12288,
            moe_intermediate_size=1536, num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4,
            head_dim=128, num_experts=128, num_experts_per_tok=8, tie_word_embeddings=False, **_MOE,
            max_position_embeddings=40960,
        ),
    },
    **LAYOUT,
)
