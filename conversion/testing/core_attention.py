"""Weightless pieces that let a CPU machine without Transformer Engine build (and run) what the
recipes train with. None of them holds a weight, so the weights, Bridge's conversion tasks and
the refit are exactly those of the model a GPU builds:

- :class:`CPUCoreAttention`: causal softmax attention for grouped queries, MLA's different
  query/key and value head dims, and context parallelism (TE's attention is the only one
  Megatron builds under CP: here keys and values are all-gathered over the CP group and the
  causal mask is taken in sequence positions of Megatron's CP split);
- :func:`sequence_parallel_norms`: Megatron's torch norms refuse ``sequence_parallel``; built from
  a config copy with it off, their parameters marked ``sequence_parallel`` as TE marks its
  norms' (their gradients are then reduced over TP, as Megatron's ``finalize_model_grads`` does).
"""

from __future__ import annotations

import contextlib
import copy
import math

import torch

from conversion.context_parallel import all_gather, local_positions


class CPUCoreAttention(torch.nn.Module):
    """Megatron's core attention interface: inputs ``[seq, batch, heads, dim]`` (this rank's heads
    and, under CP, its positions), output ``[seq, batch, heads * v_dim]``."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None,
                 **kwargs):
        super().__init__()
        self.softmax_scale = softmax_scale  # MLA builds the module again with its own scale
        self.cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        if self.cp_group is None and config.context_parallel_size > 1:
            from megatron.core import parallel_state

            self.cp_group = parallel_state.get_context_parallel_group()

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        if packed_seq_params is not None:
            raise ValueError("CPUCoreAttention does not support packed sequences")
        seq_q = query.shape[0]
        q_pos = k_pos = torch.arange(seq_q, device=query.device)
        cp = torch.distributed.get_world_size(self.cp_group) if self.cp_group is not None else 1
        if cp > 1:
            rank = torch.distributed.get_rank(self.cp_group)
            seq = seq_q * cp
            q_pos = torch.tensor(local_positions(seq, cp, rank), device=query.device)
            k_pos = torch.tensor([p for r in range(cp) for p in local_positions(seq, cp, r)], device=query.device)
            key, value = all_gather(key, 0, self.cp_group), all_gather(value, 0, self.cp_group)
        if key.shape[2] != query.shape[2]:  # grouped queries: each K/V head serves several query heads
            key = key.repeat_interleave(query.shape[2] // key.shape[2], dim=2)
            value = value.repeat_interleave(query.shape[2] // value.shape[2], dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        scale = self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
        scores = scores.masked_fill(k_pos.view(1, -1) > q_pos.view(-1, 1), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        out = torch.matmul(probs, v)  # [b, h, s, dv]
        return out.permute(2, 0, 1, 3).reshape(seq_q, out.shape[0], -1)


def with_core_attention(spec, core_attention) -> None:
    """Every layer of a layer or block spec computes attention with ``core_attention``."""
    layers = getattr(spec, "layer_specs", None) or [spec]
    for layer in layers:
        layer.submodules.self_attention.submodules.core_attention = core_attention


@contextlib.contextmanager
def sequence_parallel_norms():
    """While a model is built, Megatron's torch norms (``WrappedTorchNorm``) of a
    sequence-parallel config are built as without it, their parameters marked
    ``sequence_parallel`` (see the module docstring)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original = WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, eps=1e-5, **kwargs):
        if not config.sequence_parallel:
            return original(cls, config, hidden_size, eps, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = original(cls, plain, hidden_size, eps, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    WrappedTorchNorm.__new__ = new
    try:
        yield
    finally:
        WrappedTorchNorm.__new__ = original
