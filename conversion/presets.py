"""Hugging Face configs built in code (no hub access): tiny presets for tests and the demo,
and full-size shapes of published models for meta-device enumeration and dry runs."""

from __future__ import annotations

from typing import Any

from megatron_refit import families

PRESETS: dict[str, dict[str, Any]] = families.PRESETS
"""Every family's presets (:mod:`megatron_refit.families`), by name."""

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

    arch = fields["architectures"][0]
    return getattr(transformers, families.by_architecture(arch).architectures[arch])(**fields)


def num_routed_experts(cfg) -> int:
    """Routed experts per MoE layer (``num_experts`` or ``n_routed_experts``); 0 if dense."""
    return getattr(cfg, "num_experts", None) or getattr(cfg, "n_routed_experts", None) or 0
