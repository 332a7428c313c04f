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
    is_moe = "num_experts" in fields
    if is_moe and "ffn" in overrides and overrides["ffn"] is not None:
        fields["moe_intermediate_size"] = overrides["ffn"]
    fields.setdefault("rms_norm_eps", 1e-6)
    fields.setdefault("max_position_embeddings", 256)
    fields["dtype"] = "float32"
    if not is_moe:
        from transformers import Qwen3Config

        return Qwen3Config(**fields)
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**fields)
