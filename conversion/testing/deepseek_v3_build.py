"""DeepSeek-V3 on CPU: Megatron's per-layer block spec (dense first layers, MLA, MoE with
shared experts) without TE, and a core attention that accepts MLA's different query/key and
value head dims (the local ``DotProductAttention`` rejects ``k_channels``).
:class:`MLACoreAttention` is a plain softmax attention with no weights, so weights,
conversion tasks and refit are exactly Bridge's. Named by the family table
(:mod:`megatron_refit.families.deepseek_v3`)."""

from __future__ import annotations

import math

import torch


def configure_provider(provider, *, meta: bool) -> None:
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
