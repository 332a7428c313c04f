"""Megatron forward with trainer-side FP8 weights (quantize then dequantize in place), the
reference that an FP8 engine's logits are compared against.

Quantized Megatron params are the linear weights whose HF pieces trainer-side FP8 quantizes
(``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``, experts included; not the
router, embeddings, output layer or norms). Their 128×128 blocks in Megatron's local layout
are the HF tensors' blocks when every HF piece edge is on the 128 grid (the plan enforces
that) and each attention head spans whole blocks (``kv_channels`` a multiple of 128, checked).
"""

from __future__ import annotations

import contextlib

import torch

from megatron_refit.plan.fp8_layout import BLOCK
from megatron_refit.endpoint.fp8 import dequantize_blockwise, quantize_blockwise

LINEAR_WEIGHTS = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")


@contextlib.contextmanager
def fp8_weights(model_chunks: list, config):
    """Within the block, every quantized local weight holds ``dequantize(quantize(w))``."""
    kv_channels = config.kv_channels or config.hidden_size // config.num_attention_heads
    if kv_channels % BLOCK:
        raise ValueError(f"kv_channels={kv_channels}: the FP8 reference forward needs whole {BLOCK}-row "
                         "blocks per attention head")
    saved = []
    with torch.no_grad():
        for chunk in model_chunks:
            for name, param in chunk.named_parameters():
                if param.dim() == 2 and name.endswith(LINEAR_WEIGHTS) and ".router." not in name:
                    saved.append((param, param.detach().clone()))
                    param.copy_(dequantize_blockwise(*quantize_blockwise(param.detach()), dtype=param.dtype))
    try:
        yield
    finally:
        with torch.no_grad():
            for param, original in saved:
                param.copy_(original)
