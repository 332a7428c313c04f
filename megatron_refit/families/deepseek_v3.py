"""DeepSeek-V3: MLA attention, dense first layers, routed + shared experts, sigmoid router
with ``e_score_correction_bias``. Built on CPU by :mod:`conversion.testing.deepseek_v3_build`."""

from __future__ import annotations

import dataclasses

from megatron_refit.families.base import ModelFamily
from megatron_refit.families.hf_decoder import ENGINE_EXPERTS, ENGINE_FUSED, EXPERTS, ROLES, TINY, VOCAB

# MLA: per-head up projections are column-parallel by heads; the low-rank down projections
# (vLLM fuses them into ``fused_qkv_a_proj``) are replicated.
_MLA_ROLES = (
    ("q", r"(?:^|\.)self_attn\.(?:q_b|kv_b)_proj\.weight$"),
    ("replicated", r"(?:^|\.)self_attn\.(?:q_a_proj|kv_a_proj_with_mqa)\.weight$"),
)
_MLA_FUSED = (
    (r"(?P<p>.*\.self_attn)\.(?P<m>q_a_proj|kv_a_proj_with_mqa)\.(?P<t>weight)", "{p}.fused_qkv_a_proj.{t}",
     ("q_a_proj", "kv_a_proj_with_mqa")),
)

# SGLang's DeepseekV2AttentionMLA keeps the same fused tensor (q_a rows, then kv_a's) as
# ``fused_qkv_a_proj_with_mqa``; beside every family's spellings (the defaults).
_DEFAULT_ALIASES = next(f.default for f in dataclasses.fields(ModelFamily) if f.name == "engine_aliases")
_MLA_ALIASES = (
    (".self_attn.fused_qkv_a_proj.weight", (".self_attn.fused_qkv_a_proj.weight",
                                            ".self_attn.fused_qkv_a_proj_with_mqa.weight")),
)


def _mla_checks(cfg) -> list[tuple[str, int, str]]:
    # MLA's down projections are column-parallel in Megatron.
    return [("q_lora_rank", cfg.q_lora_rank or cfg.num_attention_heads, "tp"),
            ("kv_lora_rank + qk_rope_head_dim", cfg.kv_lora_rank + cfg.qk_rope_head_dim, "tp")]


FAMILY = ModelFamily(
    name="deepseek_v3",
    architectures={"DeepseekV3ForCausalLM": "DeepseekV3Config"},
    demo=("deepseek-v3",),
    presets={
        # 1 dense first layer, 4 routed experts + 1 shared, q/kv LoRA ranks, no MTP layer.
        "deepseek-v3": dict(TINY, architectures=["DeepseekV3ForCausalLM"], num_hidden_layers=3,
                            num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                            qk_rope_head_dim=8, v_head_dim=8, moe_intermediate_size=32, n_routed_experts=4,
                            n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                            first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                            num_nextn_predict_layers=0, head_dim=8,  # HF: head_dim = qk_rope_head_dim
                            topk_method="noaux_tc", scoring_func="sigmoid"),  # read by vLLM
        # Published shapes (config.json of deepseek-ai/DeepSeek-V3) with its MTP layer, for meta
        # enumeration and dry runs only.
        "deepseek-v3-671b": dict(
            architectures=["DeepseekV3ForCausalLM"], vocab_size=129280, hidden_size=7168, intermediate_size=18432,
            moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
            q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
            first_k_dense_replace=3, routed_scaling_factor=2.5, norm_topk_prob=True, num_nextn_predict_layers=1,
            topk_method="noaux_tc", scoring_func="sigmoid", tie_word_embeddings=False,
            max_position_embeddings=163840,
        ),
        # Published shapes (config.json of moonshotai/Kimi-K2-Instruct: DeepSeek-V3's architecture with
        # 384 routed experts, 64 heads, one dense layer, no MTP layer), for dry runs only.
        "kimi-k2": dict(
            architectures=["DeepseekV3ForCausalLM"], vocab_size=163840, hidden_size=7168, intermediate_size=18432,
            moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=64, num_key_value_heads=64,
            q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1,
            first_k_dense_replace=1, routed_scaling_factor=2.827, norm_topk_prob=True, num_nextn_predict_layers=0,
            topk_method="noaux_tc", scoring_func="sigmoid", tie_word_embeddings=False, rope_theta=50000.0,
            max_position_embeddings=131072,
        ),
    },
    roles=_MLA_ROLES + ROLES,
    expert_prefix=EXPERTS,
    engine_experts=ENGINE_EXPERTS,
    engine_fused=ENGINE_FUSED[:1] + _MLA_FUSED + ENGINE_FUSED[1:],
    engine_aliases=_DEFAULT_ALIASES + _MLA_ALIASES,
    vocab=VOCAB,
    build="conversion.testing.deepseek_v3_build",
    layout_checks=lambda cfg: _mla_checks(cfg) if getattr(cfg, "kv_lora_rank", None) else [],
)
