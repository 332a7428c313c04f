"""Per-family settings for building a model on CPU / the meta device through Megatron-Bridge.

Qwen3 and Llama build with Bridge's local (non-TE) layer spec. DeepSeek-V3 needs its own
per-layer block spec (dense first layers, MLA, MoE with shared experts) and a core
attention that accepts MLA's different query/key and value head dims: the local
``DotProductAttention`` rejects ``k_channels``. :class:`MLACoreAttention` is a plain
softmax attention with no weights, so weights, conversion tasks and refit are exactly
Bridge's. Nemotron-H (hybrid Mamba) cannot be built without ``mamba_ssm``, a CUDA package.
"""

from __future__ import annotations

import contextlib
import math

import torch

CPU_FAMILIES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
"""HF architectures this project builds on CPU, by family."""

NOT_ON_CPU = {
    "NemotronHForCausalLM": (
        "Nemotron-H builds through Megatron's HybridModel, whose MambaMixer needs the CUDA "
        "package mamba_ssm (and its Triton gated RMSNorm); it cannot be built on CPU. "
        "Its mapping and local-split rules are tested at mapping level; the refit itself "
        "needs a GPU machine"
    ),
}


def family(hf_config) -> str:
    """The family of ``hf_config``; ``ValueError`` naming the architecture if unsupported."""
    arch = (getattr(hf_config, "architectures", None) or [None])[0]
    if arch in NOT_ON_CPU:
        raise ValueError(f"{arch}: {NOT_ON_CPU[arch]}")
    if arch not in CPU_FAMILIES:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {sorted(CPU_FAMILIES)}")
    return CPU_FAMILIES[arch]


def configure_provider(provider, hf_config) -> None:
    """Family-specific provider settings for a CPU build (after the common ones)."""
    if family(hf_config) != "deepseek_v3":
        return
    provider.transformer_layer_spec = mla_block_spec
    # The shared-expert overlap needs CUDA streams (make_provider turned the fusions off).
    provider.moe_shared_expert_overlap = False


def mla_block_spec(config, vp_stage=None):
    """Megatron's per-layer GPT block spec without TE, with :class:`MLACoreAttention`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage)
    for layer in block.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = MLACoreAttention
    return block


class MLACoreAttention(torch.nn.Module):
    """Causal softmax attention for MLA (query/key head dim != value head dim), no weights.

    Inputs ``[seq, batch, heads, dim]`` (this rank's heads), output
    ``[seq, batch, heads * v_dim]``, as Megatron's core attention modules."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None,
                 k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None, **kwargs):
        super().__init__()
        if config.context_parallel_size != 1:
            raise ValueError(f"MLACoreAttention supports no context parallelism, got cp={config.context_parallel_size}")
        # The base Attention class builds this module once without MLA's head dims; MLA then
        # builds it again with its softmax_scale.
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, packed_seq_params=None, attn_mask_type=None, **kwargs):
        if packed_seq_params is not None:
            raise ValueError("MLACoreAttention does not support packed sequences")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        scale = self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
        seq_q, seq_k = scores.shape[-2:]
        causal = torch.ones(seq_q, seq_k, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(causal, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        out = torch.matmul(probs, v)  # [b, h, s, dv]
        return out.permute(2, 0, 1, 3).reshape(seq_q, out.shape[0], -1)


@contextlib.contextmanager
def cpu_device_for_buffers(meta: bool):
    """Megatron's MoE router creates ``expert_bias`` (DeepSeek's
    ``e_score_correction_bias``) on ``torch.cuda.current_device()``; on a CPU machine
    answer "cpu" (or "meta" for a meta-device build) while the model is built."""
    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: "meta" if meta else "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = saved
