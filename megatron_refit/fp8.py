"""Blockwise FP8 reference math (pure torch, no distributed import).

Format of DeepSeek-V3 / Hugging Face / vLLM block-quantised checkpoints: ``weight`` in
``float8_e4m3fn`` with its logical shape ``[out, in]`` and ``weight_scale_inv`` in float32
of shape ``[ceil(out / bm), ceil(in / bk)]`` (``bm × bk`` = 128×128 for weights, 1×128 for
activation-style tiles). ``x ≈ q * scale_inv`` block by block.

Per block: ``amax = max|x|`` over the block (edge blocks zero-padded); ``scale = 448 / amax``
(IEEE float32 division); ``amax == 0`` gives scale 1; an infinite scale (subnormal amax)
becomes the largest float32; ``pow2_scales`` floors the scale to a power of two (Transformer
Engine's default); ``q = cast(clamp(x * scale, -448, 448))`` (the clamp matters: torch's
cast to e4m3fn does not saturate); ``scale_inv = 1 / scale``.

Which parameters are quantised and how FP8 tensors map onto boxes is also here: a shard
boundary inside a quantised dim must sit on a block edge, or per-shard scales would differ
from the full tensor's.
"""

from __future__ import annotations

import math

import torch

from .spec import Box, ShardSpec

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
"""Largest finite ``float8_e4m3fn`` value."""
BLOCK = 128
"""Edge of a weight block (128×128)."""
SCALE_SUFFIX = "_scale_inv"
_F32_MAX = torch.finfo(torch.float32).max


def scale_shape(shape: tuple[int, ...], block: tuple[int, int] = (BLOCK, BLOCK)) -> tuple[int, int]:
    """Shape of the ``scale_inv`` tensor of a 2-D tensor of ``shape``."""
    if len(shape) != 2:
        raise ValueError(f"blockwise FP8 needs a 2-D tensor, got shape {tuple(shape)}")
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


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


# --- which parameters, and their boxes ------------------------------------------------

QUANTISED_ROLES = frozenset({"q", "kv", "column", "expert_column", "row", "expert_row"})
"""Sharding roles (``gen_layout.param_role``) of the linear weights that are quantised:
q/k/v/o and gate/up/down, routed and shared experts included. Embeddings and lm_head
(role ``vocab``), norms, the MoE router and biases (``replicated`` or not ``.weight``)
keep their training dtype."""


def is_quantised(name: str, shape: tuple[int, ...]) -> bool:
    """True if trainer-side FP8 quantises HF parameter ``name`` (decided by its role)."""
    from .gen_layout import param_role

    if len(shape) != 2 or not name.endswith(".weight"):
        return False
    return param_role(name, 2) in QUANTISED_ROLES


def scale_name(weight_name: str) -> str:
    """``...proj.weight`` → ``...proj.weight_scale_inv``."""
    return weight_name + SCALE_SUFFIX


def weight_name(name: str) -> str | None:
    """The weight a ``*_scale_inv`` name belongs to, or None for any other name."""
    return name.removesuffix(SCALE_SUFFIX) if name.endswith(SCALE_SUFFIX) else None


def scale_box(name: str, box: Box, global_shape: tuple[int, ...], block: int = BLOCK) -> Box:
    """The ``scale_inv`` tiles of a weight box; ``ValueError`` naming parameter, dim and
    boundary when a box edge is not on a block edge (and not the tensor's end)."""
    for dim, ((start, stop), size) in enumerate(zip(box, global_shape)):
        for edge in (start, stop):
            if edge % block and edge != size:
                raise ValueError(
                    f"{name}: shard boundary {edge} in dim {dim} (size {size}) is not a multiple of "
                    f"{block}; blockwise FP8 needs every shard of a quantised weight to start and end "
                    f"on a {block}-element block edge (box {box})"
                )
    return tuple((start // block, math.ceil(stop / block)) for start, stop in box)


def fp8_specs(spec: ShardSpec) -> tuple[ShardSpec, ShardSpec]:
    """The FP8 weight spec and its ``scale_inv`` spec for a quantised weight's spec."""
    tiles = scale_box(spec.name, spec.box, spec.global_shape)
    weight = ShardSpec(name=spec.name, global_shape=spec.global_shape, dtype="float8_e4m3fn", box=spec.box,
                       pp_stage=spec.pp_stage, is_expert=spec.is_expert)
    scale = ShardSpec(name=scale_name(spec.name), global_shape=scale_shape(spec.global_shape), dtype="float32",
                      box=tiles, pp_stage=spec.pp_stage, is_expert=spec.is_expert)
    return weight, scale


def fp8_param_table(params: dict[str, tuple[tuple[int, ...], str]]) -> dict[str, tuple[tuple[int, ...], str]]:
    """An HF parameter table as an FP8 checkpoint has it: quantised weights in
    ``float8_e4m3fn`` plus their ``weight_scale_inv``; the rest unchanged."""
    out = {}
    for name, (shape, dtype) in params.items():
        if is_quantised(name, tuple(shape)):
            out[name] = (tuple(shape), "float8_e4m3fn")
            out[scale_name(name)] = (scale_shape(tuple(shape)), "float32")
        else:
            out[name] = (tuple(shape), dtype)
    return out
