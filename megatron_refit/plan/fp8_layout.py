"""Which parameters trainer-side FP8 quantizes, and the boxes of FP8 tensors (pure Python:
no torch import, so the dry run's plan stays light).

A shard boundary inside a quantized dim must sit on a 128 block edge, or per-shard scales
would differ from the full tensor's.
"""

from __future__ import annotations

import math

from megatron_refit.plan.roles import is_quantized_role
from megatron_refit.plan.spec import Box, ShardSpec

BLOCK = 128
"""Edge of a weight block (128×128)."""
SCALE_SUFFIX = "_scale_inv"


def scale_shape(shape: tuple[int, ...], block: tuple[int, int] = (BLOCK, BLOCK)) -> tuple[int, int]:
    """Shape of the ``scale_inv`` tensor of a 2-D tensor of ``shape``."""
    if len(shape) != 2:
        raise ValueError(f"blockwise FP8 needs a 2-D tensor, got shape {tuple(shape)}")
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def is_quantized(name: str, shape: tuple[int, ...]) -> bool:
    """True if trainer-side FP8 quantizes HF parameter ``name`` (decided by its role)."""
    if len(shape) != 2 or not name.endswith(".weight"):
        return False
    return is_quantized_role(name)


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
                    f"{block}; blockwise FP8 needs every shard of a quantized weight to start and end "
                    f"on a {block}-element block edge (box {box})"
                )
    return tuple((start // block, math.ceil(stop / block)) for start, stop in box)


def fp8_specs(spec: ShardSpec) -> tuple[ShardSpec, ShardSpec]:
    """The FP8 weight spec and its ``scale_inv`` spec for a quantized weight's spec."""
    tiles = scale_box(spec.name, spec.box, spec.global_shape)
    weight = ShardSpec(name=spec.name, global_shape=spec.global_shape, dtype="float8_e4m3fn", box=spec.box,
                       pp_stage=spec.pp_stage, is_expert=spec.is_expert)
    scale = ShardSpec(name=scale_name(spec.name), global_shape=scale_shape(spec.global_shape), dtype="float32",
                      box=tiles, pp_stage=spec.pp_stage, is_expert=spec.is_expert)
    return weight, scale


def fp8_param_table(params: dict[str, tuple[tuple[int, ...], str]]) -> dict[str, tuple[tuple[int, ...], str]]:
    """An HF parameter table as an FP8 checkpoint has it: quantized weights in
    ``float8_e4m3fn`` plus their ``weight_scale_inv``; the rest unchanged."""
    out = {}
    for name, (shape, dtype) in params.items():
        if is_quantized(name, tuple(shape)):
            out[name] = (tuple(shape), "float8_e4m3fn")
            out[scale_name(name)] = (scale_shape(tuple(shape)), "float32")
        else:
            out[name] = (tuple(shape), dtype)
    return out
