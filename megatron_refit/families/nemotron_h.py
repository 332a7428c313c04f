"""Nemotron-H: hybrid Mamba2 / attention / MoE with non-gated ReLU² experts, ``backbone.*``
names. Built on CPU by :mod:`conversion.testing.nemotron_h_build`.

Mamba's ``in_proj`` is [z, x, B, C, dt] and ``conv1d`` [x, B, C] along dim 0, each part
sharded by heads / groups on its own: a tensor-parallel rank holds one box of each part
(several disjoint row ranges of the HF tensor), so refits move them as segments.
"""

from __future__ import annotations

from megatron_refit.families.base import ModelFamily

_MIXER = r"(?:^|\.)mixer\."
_EXPERT = _MIXER + r"experts\.\d+\."
_SEGMENT = r"#[A-Za-z]+$"

ROLES: tuple[tuple[str, str], ...] = (
    ("column", _MIXER + r"in_proj\.weight" + _SEGMENT),
    ("column", _MIXER + r"conv1d\.(?:weight|bias)" + _SEGMENT),
    ("column", _MIXER + r"(?:A_log|D|dt_bias|norm\.weight)$"),  # per head / per channel of the local heads
    ("row", _MIXER + r"out_proj\.weight$"),
    ("q", _MIXER + r"q_proj\.weight$"),
    ("kv", _MIXER + r"[kv]_proj\.weight$"),
    ("row", _MIXER + r"o_proj\.weight$"),
    ("expert_column", _EXPERT + r"up_proj\.weight$"),
    ("expert_row", _EXPERT + r"down_proj\.weight$"),
    ("column", _MIXER + r"(?:shared_experts\.)?up_proj\.weight$"),
    ("row", _MIXER + r"(?:shared_experts\.)?down_proj\.weight$"),
    ("replicated", _MIXER + r"gate\.weight$"),  # MoE router
    ("vocab", r"^backbone\.embeddings\.weight$"),
    ("vocab", r"^lm_head\.weight$"),
)


def _block_types(pattern: str) -> list[str]:
    """``hybrid_override_pattern`` (M: Mamba, *: attention, E: MoE, -: MLP) as ``layers_block_type``."""
    kinds = {"M": "mamba", "*": "attention", "E": "moe", "-": "mlp"}
    return [kinds[c] for c in pattern]


def _in_proj(cfg) -> tuple[int, ...]:
    """Rows of in_proj's z, x, B, C, dt."""
    inner, state = cfg.mamba_num_heads * cfg.mamba_head_dim, cfg.n_groups * cfg.ssm_state_size
    return inner, inner, state, state, cfg.mamba_num_heads


def _conv1d(cfg) -> tuple[int, ...]:
    """Rows of conv1d's x, B, C."""
    return _in_proj(cfg)[1:4]


def _mamba_checks(cfg) -> list[tuple[str, int, str]]:
    return [("mamba_num_heads", cfg.mamba_num_heads, "tp"), ("n_groups", cfg.n_groups, "tp")]


FAMILY = ModelFamily(
    name="nemotron_h",
    architectures={"NemotronHForCausalLM": "NemotronHConfig"},
    demo=("nemotron-h",),
    presets={
        # Mamba, attention, MoE (4 ReLU² experts + 1 shared), dense MLP.
        "nemotron-h": dict(
            architectures=["NemotronHForCausalLM"], vocab_size=250, hidden_size=64, num_hidden_layers=4,
            layers_block_type=["mamba", "attention", "moe", "mlp"], num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, intermediate_size=96, mamba_num_heads=8, mamba_head_dim=8,
            ssm_state_size=16, n_groups=2, conv_kernel=4, expand=1, chunk_size=16, n_routed_experts=4,
            n_shared_experts=1, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32,
            num_experts_per_tok=2, tie_word_embeddings=False,
        ),
        # Published shapes (config.json of nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16): 23 Mamba,
        # 23 MoE (128 ReLU² experts + 1 shared), 6 attention layers. For dry runs only.
        "nemotron-3-nano-30b-a3b": dict(
            architectures=["NemotronHForCausalLM"], vocab_size=131072, hidden_size=2688, num_hidden_layers=52,
            layers_block_type=_block_types("MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"),
            num_attention_heads=32, num_key_value_heads=2, head_dim=128, intermediate_size=1856,
            mamba_num_heads=64, mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4, expand=2,
            chunk_size=128, n_routed_experts=128, n_shared_experts=1, moe_intermediate_size=1856,
            moe_shared_expert_intermediate_size=3712, num_experts_per_tok=6, n_group=1, topk_group=1,
            norm_topk_prob=True, routed_scaling_factor=2.5, tie_word_embeddings=False,
            max_position_embeddings=262144,
        ),
    },
    roles=ROLES,
    expert_prefix=r"mixer\.experts",
    engine_experts=r"(?P<p>.*\.mixer\.experts)\.(?P<e>\d+)\.(?P<m>up|down)_proj\.(?P<t>weight)",
    # vLLM's NemotronHForCausalLM (0.33): qkv_proj; in_proj and conv1d are merged
    # column-parallel layers over the segments, each rank's rows [z_r; x_r; B_r; C_r; dt_r].
    engine_fused=(
        (r"(?P<p>.*\.mixer)\.(?P<m>[qkv])_proj\.(?P<t>weight)", "{p}.qkv_proj.{t}", ("q", "k", "v")),
        (r"(?P<p>.*\.mixer)\.in_proj\.(?P<t>weight)#(?P<m>\w+)", "{p}.in_proj.{t}", ("z", "x", "B", "C", "dt")),
        (r"(?P<p>.*\.mixer)\.conv1d\.(?P<t>weight|bias)#(?P<m>\w+)", "{p}.conv1d.{t}", ("x", "B", "C")),
    ),
    engine_renames=((r"^backbone\.", "model."), (r"^model\.embeddings\.", "model.embed_tokens.")),
    engine_transforms=((r"\.mixer\.A_log$", ".mixer.A", "neg_exp_fp32"),),
    vocab=("backbone.embeddings.weight", "lm_head.weight"),
    segments=(
        (r".*\.mixer\.in_proj\.weight", ("z", "x", "B", "C", "dt"), _in_proj),
        (r".*\.mixer\.conv1d\.(?:weight|bias)", ("x", "B", "C"), _conv1d),
    ),
    checkpoint_renames=((r"^model\.", "backbone."),),
    build="conversion.testing.nemotron_h_build",
    layout_checks=_mamba_checks,
)
