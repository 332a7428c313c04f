"""Blockwise FP8 reference math (pure torch, no distributed import).

Format of DeepSeek-V3 / Hugging Face / vLLM block-quantized checkpoints: ``weight`` in
``float8_e4m3fn`` with its logical shape ``[out, in]`` and ``weight_scale_inv`` in float32
of shape ``[ceil(out / bm), ceil(in / bk)]`` (``bm × bk`` = 128×128 for weights, 1×128 for
activation-style tiles). ``x ≈ q * scale_inv`` block by block.

Per block: ``amax = max|x|`` over the block (edge blocks zero-padded); ``scale = 448 / amax``
(IEEE float32 division); ``amax == 0`` gives scale 1; an infinite scale (subnormal amax)
becomes the largest float32; ``pow2_scales`` floors the scale to a power of two (Transformer
Engine's default); ``q = cast(clamp(x * scale, -448, 448))`` (the clamp matters: torch's
cast to e4m3fn does not saturate); ``scale_inv = 1 / scale``.

Which parameters are quantized and how FP8 tensors map onto boxes lives in the torch-free
:mod:`megatron_refit.plan.fp8_layout` (re-exported here).
"""

from __future__ import annotations

import torch

from megatron_refit.plan.fp8_layout import (
    BLOCK,
    is_quantized,
    scale_name,
    scale_shape,
)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
"""Largest finite ``float8_e4m3fn`` value."""
_F32_MAX = torch.finfo(torch.float32).max


def _scales(amax: torch.Tensor, pow2_scales: bool) -> torch.Tensor:
    scale = torch.full_like(amax, FP8_MAX) / amax
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, _F32_MAX), scale)
    if pow2_scales:
        # frexp: scale = m * 2**e with m in [0.5, 1), so the largest power of two <= scale is 2**(e-1)
        _, exponent = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), exponent - 1)
    return scale


def _blocks(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``x`` zero-padded to whole blocks, viewed as ``[Mb, bm, Kb, bk]``."""
    rows, cols = scale_shape(tuple(x.shape), block)
    if (rows * block[0], cols * block[1]) == tuple(x.shape) and x.is_contiguous():
        return x.view(rows, block[0], cols, block[1])  # whole blocks: no copy
    padded = torch.zeros(rows * block[0], cols * block[1], dtype=x.dtype, device=x.device)
    padded[: x.shape[0], : x.shape[1]] = x
    return padded.view(rows, block[0], cols, block[1])


def quantize_blockwise(
    x: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK), *, pow2_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q float8_e4m3fn shaped like x, scale_inv float32 [ceil(M/bm), ceil(K/bk)])``."""
    if x.dim() != 2:
        raise ValueError(f"blockwise FP8 needs a 2-D tensor, got shape {tuple(x.shape)}")
    if not x.is_floating_point() or x.dtype == FP8_DTYPE:
        raise ValueError(f"quantize_blockwise needs a high-precision float tensor, got {x.dtype}")
    blocks = _blocks(x.float() if x.dtype != torch.float32 else x.clone(), block)  # a fresh float32 copy
    amax = torch.maximum(blocks.amax(dim=(1, 3)), blocks.amin(dim=(1, 3)).neg())  # max|x|, no temporary
    scale = _scales(amax, pow2_scales)
    _scale_blocks_(blocks, scale)
    q = blocks.clamp_(-FP8_MAX, FP8_MAX).view(blocks.shape[0] * block[0], -1)[: x.shape[0], : x.shape[1]]
    return q.to(FP8_DTYPE), torch.reciprocal(scale)


def _scale_blocks_(blocks: torch.Tensor, scale: torch.Tensor) -> None:
    """``blocks *= scale`` per block, in place (an expanded operand keeps the loop vectorised;
    a broadcast ``[Mb, 1, Kb, 1]`` operand is several times slower on CPU)."""
    torch.mul(blocks, scale.view(scale.shape[0], 1, scale.shape[1], 1).expand_as(blocks), out=blocks)


def dequantize_blockwise(
    q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK),
    *, dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``q * scale_inv`` block by block, in ``dtype``."""
    if q.dtype != FP8_DTYPE:
        raise ValueError(f"dequantize_blockwise needs float8_e4m3fn data, got {q.dtype}")
    if tuple(scale_inv.shape) != scale_shape(tuple(q.shape), block):
        raise ValueError(
            f"scale_inv shape {tuple(scale_inv.shape)} does not match data {tuple(q.shape)} "
            f"in {block[0]}x{block[1]} blocks (expected {scale_shape(tuple(q.shape), block)})"
        )
    blocks = _blocks(q.float(), block)  # a fresh float32 tensor: scaled in place
    _scale_blocks_(blocks, scale_inv.float())
    return blocks.view(blocks.shape[0] * block[0], -1)[: q.shape[0], : q.shape[1]].to(dtype)


def fp8_checkpoint(tensors: dict[str, torch.Tensor], *, pow2_scales: bool = False) -> dict[str, torch.Tensor]:
    """Full HF tensors as an FP8 checkpoint: quantized weights as FP8 data + ``weight_scale_inv``,
    the rest unchanged (what trainer-side FP8 must deliver, and what an FP8 engine loads)."""
    out = {}
    for name, tensor in tensors.items():
        if is_quantized(name, tuple(tensor.shape)):
            out[name], out[scale_name(name)] = quantize_blockwise(tensor, pow2_scales=pow2_scales)
        else:
            out[name] = tensor
    return out
