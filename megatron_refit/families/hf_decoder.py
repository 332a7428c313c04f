"""The layout most HF decoders share (``model.layers.N.{self_attn,mlp}``): Qwen3, Llama,
DeepSeek-V3 build their tables from it."""

from __future__ import annotations

EXPERTS = r"mlp\.experts"
_EXPERT = r"(?:^|\.)" + EXPERTS + r"\.\d+\."
_SHARED = r"(?:^|\.)mlp\.shared_experts?\."

ROLES: tuple[tuple[str, str], ...] = (
    ("q", r"(?:^|\.)self_attn\.q_proj\.(?:weight|bias)$"),
    ("kv", r"(?:^|\.)self_attn\.[kv]_proj\.(?:weight|bias)$"),
    ("column", r"(?:^|\.)mlp\.(?:gate|up)_proj\.(?:weight|bias)$"),
    ("column", _SHARED + r"(?:gate|up)_proj\.(?:weight|bias)$"),
    ("expert_column", _EXPERT + r"(?:gate|up)_proj\.(?:weight|bias)$"),
    ("row", r"(?:^|\.)self_attn\.o_proj\.weight$"),
    ("row", r"(?:^|\.)mlp\.down_proj\.weight$"),
    ("row", _SHARED + r"down_proj\.weight$"),
    ("expert_row", _EXPERT + r"down_proj\.weight$"),
    ("expert_replicated", _EXPERT + r"down_proj\.bias$"),
    ("vocab", r"(?:^|\.)embed_tokens\.weight$"),
    ("vocab", r"^lm_head\.weight$"),
    ("replicated", r"(?:^|\.)mlp\.gate\.weight$"),  # MoE router
    ("replicated", r"(?:^|\.)mlp\.shared_expert_gate\.weight$"),
)

# FP8 ``weight_scale_inv`` tiles fuse exactly like their weights (rows in 128-row tiles).
ENGINE_FUSED: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (r"(?P<p>.*\.self_attn)\.(?P<m>[qkv])_proj\.(?P<t>weight|bias|weight_scale_inv)", "{p}.qkv_proj.{t}",
     ("q", "k", "v")),
    (r"(?P<p>.*\.mlp)\.(?P<m>gate|up)_proj\.(?P<t>weight|weight_scale_inv)", "{p}.gate_up_proj.{t}", ("gate", "up")),
    (r"(?P<p>.*\.shared_experts?)\.(?P<m>gate|up)_proj\.(?P<t>weight|weight_scale_inv)", "{p}.gate_up_proj.{t}",
     ("gate", "up")),
)
ENGINE_EXPERTS = r"(?P<p>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<m>gate|up|down)_proj\.(?P<t>weight|weight_scale_inv)"
VOCAB = ("model.embed_tokens.weight", "lm_head.weight")

TINY = dict(
    vocab_size=250,  # not a multiple of 128: exercises vocab padding
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    tie_word_embeddings=False,
)
"""Shared fields of the tiny presets."""

LAYOUT = dict(roles=ROLES, expert_prefix=EXPERTS, engine_experts=ENGINE_EXPERTS, engine_fused=ENGINE_FUSED,
              vocab=VOCAB)
"""The table fields of a family that follows this layout as it is."""
