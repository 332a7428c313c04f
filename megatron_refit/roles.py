"""The role of each HF parameter in tensor-parallel sharding (pure): decided by the last
components of its name, the same for every family that spells its layers as HF does.

``gen_layout`` shards by role; trainer-side FP8 (``fp8_layout.QUANTISED_ROLES``) and the LoRA
receiver (``receivers.lora.ADAPTED_ROLES``) select parameters by role.
"""

from __future__ import annotations

import re

_EXPERT = r"(?:^|\.)mlp\.experts\.(?P<expert>\d+)\."
EXPERT_RE = re.compile(_EXPERT)
"""A routed expert's parameter; group ``expert``: its index."""
_SHARED = r"(?:^|\.)mlp\.shared_experts?\."
_ROLES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (role, re.compile(pattern))
    for role, pattern in (
        ("q", r"(?:^|\.)self_attn\.q_proj\.(?:weight|bias)$"),
        ("kv", r"(?:^|\.)self_attn\.[kv]_proj\.(?:weight|bias)$"),
        # MLA (DeepSeek): per-head up projections are column-parallel by heads; the low-rank
        # down projections (vLLM fuses them into ``fused_qkv_a_proj``) are replicated.
        ("q", r"(?:^|\.)self_attn\.(?:q_b|kv_b)_proj\.weight$"),
        ("replicated", r"(?:^|\.)self_attn\.(?:q_a_proj|kv_a_proj_with_mqa)\.weight$"),
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
        # Replicated parameters of 2 or more dims; any other 1-D parameter is replicated too.
        ("replicated", r"(?:^|\.)mlp\.gate\.weight$"),  # MoE router
        ("replicated", r"(?:^|\.)mlp\.shared_expert_gate\.weight$"),
    )
)


def param_role(name: str, ndim: int) -> str:
    """Sharding role of HF parameter ``name``; ``ValueError`` for an unknown tensor of 2+ dims."""
    for role, pattern in _ROLES:
        if pattern.search(name):
            return role
    if ndim <= 1:
        return "replicated"
    raise ValueError(f"no vLLM sharding rule for parameter {name!r} ({ndim} dims)")
