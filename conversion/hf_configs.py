"""Hugging Face configs built in code (no hub access): tiny presets for tests and the demo,
and full-size shapes of published models for meta-device enumeration and dry runs."""

from __future__ import annotations

from typing import Any

_TINY = dict(
    vocab_size=250,  # not a multiple of 128: exercises vocab padding
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    tie_word_embeddings=False,
)
_MOE = dict(decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3": dict(_TINY, architectures=["Qwen3ForCausalLM"]),
    "qwen3-moe": dict(_TINY, architectures=["Qwen3MoeForCausalLM"], moe_intermediate_size=32, num_experts=4,
                      num_experts_per_tok=2, **_MOE),
    # Published shapes (config.json of Qwen/Qwen3-30B-A3B), for meta enumeration only.
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"],
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        tie_word_embeddings=False,
        **_MOE,
        max_position_embeddings=40960,
    ),
    # Llama 3: no QK norm; untied and tied embeddings.
    "llama3": dict(_TINY, architectures=["LlamaForCausalLM"], rope_theta=500000.0),
    "llama3-tied": dict(_TINY, architectures=["LlamaForCausalLM"], rope_theta=500000.0, tie_word_embeddings=True),
    # DeepSeek-V3: MLA (q/kv LoRA ranks, rope part of kv_a), 1 dense first layer, 4 routed
    # experts + 1 shared, sigmoid router with e_score_correction_bias. No MTP layer.
    "deepseek-v3": dict(_TINY, architectures=["DeepseekV3ForCausalLM"], num_hidden_layers=3,
                        num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                        qk_rope_head_dim=8, v_head_dim=8, moe_intermediate_size=32, n_routed_experts=4,
                        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                        num_nextn_predict_layers=0, head_dim=8,  # HF: head_dim = qk_rope_head_dim
                        topk_method="noaux_tc", scoring_func="sigmoid"),  # read by vLLM
    # Published shapes (config.json of deepseek-ai/DeepSeek-V3) without its MTP layer
    # (num_nextn_predict_layers=1 there), for meta enumeration and dry runs only.
    "deepseek-v3-671b": dict(
        architectures=["DeepseekV3ForCausalLM"],
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        first_k_dense_replace=3,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        num_nextn_predict_layers=0,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        tie_word_embeddings=False,
        max_position_embeddings=163840,
    ),
    # Nemotron-H: Mamba2 mixers, attention, non-gated ReLU^2 MoE (up/down experts).
    # Not buildable on CPU (mamba_ssm); used at mapping level.
    "nemotron-h": dict(
        architectures=["NemotronHForCausalLM"], vocab_size=250, hidden_size=64, num_hidden_layers=4,
        layers_block_type=["mamba", "attention", "moe", "mlp"], num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=96, mamba_num_heads=8, mamba_head_dim=8,
        ssm_state_size=16, n_groups=2, conv_kernel=4, expand=1, chunk_size=16, n_routed_experts=4,
        n_shared_experts=1, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32,
        num_experts_per_tok=2, tie_word_embeddings=False,
    ),
    # Published shapes (config.json of Qwen/Qwen3-4B): dense, tied embeddings.
    "qwen3-4b": dict(
        architectures=["Qwen3ForCausalLM"],
        vocab_size=151936,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
    ),
    # Published shapes (config.json of Qwen/Qwen3-235B-A22B).
    "qwen3-235b-a22b": dict(
        architectures=["Qwen3MoeForCausalLM"],
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        moe_intermediate_size=1536,
        num_hidden_layers=94,
        num_attention_heads=64,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        tie_word_embeddings=False,
        **_MOE,
        max_position_embeddings=40960,
    ),
}

_CONFIG_CLASS = {
    "Qwen3ForCausalLM": "Qwen3Config",
    "Qwen3MoeForCausalLM": "Qwen3MoeConfig",
    "LlamaForCausalLM": "LlamaConfig",
    "DeepseekV3ForCausalLM": "DeepseekV3Config",
    "NemotronHForCausalLM": "NemotronHConfig",
}
"""transformers config class per architecture."""

# Command-line shape overrides -> HF config field.
OVERRIDE_FIELDS = {
    "hidden": "hidden_size",
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "experts": "num_experts",
    "vocab": "vocab_size",
    "ffn": "intermediate_size",
    "head_dim": "head_dim",
}


def hf_config(model: str = "qwen3", **overrides: Any):
    """A transformers config for the named preset, with HF field overrides applied."""
    if model not in PRESETS:
        raise ValueError(f"unknown model preset {model!r}; choose from {sorted(PRESETS)}")
    fields = dict(PRESETS[model])
    for key, value in overrides.items():
        if value is not None:
            fields[OVERRIDE_FIELDS.get(key, key)] = value
    if "n_routed_experts" in fields and "num_experts" in fields:  # DeepSeek / Nemotron-H spelling
        fields["n_routed_experts"] = fields.pop("num_experts")
    is_moe = "num_experts" in fields or "n_routed_experts" in fields
    if is_moe and "ffn" in overrides and overrides["ffn"] is not None:
        fields["moe_intermediate_size"] = overrides["ffn"]
    if "layers_block_type" not in fields:
        fields.setdefault("rms_norm_eps", 1e-6)
    fields.setdefault("max_position_embeddings", 256)
    fields["dtype"] = "float32"
    import transformers

    return getattr(transformers, _CONFIG_CLASS[fields["architectures"][0]])(**fields)


def num_routed_experts(cfg) -> int:
    """Routed experts per MoE layer (``num_experts`` or ``n_routed_experts``); 0 if dense."""
    return getattr(cfg, "num_experts", None) or getattr(cfg, "n_routed_experts", None) or 0
