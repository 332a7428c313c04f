"""Shard metadata: where a rank's local piece sits inside a global HF tensor (pure)."""

from __future__ import annotations

import math
from dataclasses import dataclass

Box = tuple[tuple[int, int], ...]
"""Half-open ``(start, stop)`` per tensor dim."""


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """What a piece is, without its bytes: which Hugging Face parameter, its global shape and
    dtype, and the box of it one rank holds (the plan is built from these alone, on every rank)."""

    name: str
    """Hugging Face parameter name (global expert and layer numbering)."""
    global_shape: tuple[int, ...]
    """Shape of the full HF tensor."""
    dtype: str
    """torch dtype name of the local tensor, e.g. ``"float32"``, ``"float8_e4m3fn"``."""
    box: Box
    """This rank's region of the global tensor."""
    pp_stage: int = 0
    """Pipeline stage that holds the parameter."""
    is_expert: bool = False
    """True for routed-expert parameters (sharded by EP/ETP rather than TP)."""

    def __post_init__(self) -> None:
        if len(self.box) != len(self.global_shape):
            raise ValueError(f"{self.name}: box {self.box} has {len(self.box)} dims, global shape {self.global_shape}")
        for (start, stop), size in zip(self.box, self.global_shape):
            if not 0 <= start < stop <= size:
                dim = next(d for d, ((a, b), n) in enumerate(zip(self.box, self.global_shape)) if not 0 <= a < b <= n)
                raise ValueError(f"{self.name}: box {self.box} dim {dim} outside global shape {self.global_shape}")

    @classmethod
    def trusted(cls, name: str, global_shape: tuple[int, ...], dtype: str, box: Box, *, pp_stage: int = 0,
                is_expert: bool = False) -> ShardSpec:
        """A ShardSpec whose ``box`` was built from ``global_shape`` (``full_box``, ``box_along``
        with checked bounds), without :meth:`__post_init__`'s check: the hot path when a
        plan enumerates hundreds of thousands of gen pieces."""
        spec = object.__new__(cls)
        _SET_NAME(spec, name)
        _SET_SHAPE(spec, global_shape)
        _SET_DTYPE(spec, dtype)
        _SET_BOX(spec, box)
        _SET_STAGE(spec, pp_stage)
        _SET_EXPERT(spec, is_expert)
        return spec

    @property
    def shape(self) -> tuple[int, ...]:
        return box_shape(self.box)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


# Slot setters of the frozen class, for ShardSpec.trusted (3x faster than __init__).
_SET_NAME, _SET_SHAPE, _SET_DTYPE, _SET_BOX, _SET_STAGE, _SET_EXPERT = (
    getattr(ShardSpec, field).__set__ for field in ("name", "global_shape", "dtype", "box", "pp_stage", "is_expert")
)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def box_numel(box: Box) -> int:
    """Elements in ``box``."""
    return math.prod(stop - start for start, stop in box)


def full_box(shape: tuple[int, ...]) -> Box:
    return tuple((0, size) for size in shape)


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes, or None if they do not overlap."""
    out = []
    for (a0, a1), (b0, b1) in zip(a, b, strict=True):
        lo, hi = max(a0, b0), min(a1, b1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def relative(inner: Box, outer: Box) -> Box:
    """``inner`` expressed in the coordinates of ``outer`` (which must contain it)."""
    return tuple((i0 - o0, i1 - o0) for (i0, i1), (o0, _) in zip(inner, outer, strict=True))


def box_along(shape: tuple[int, ...], dim: int, start: int, stop: int) -> Box:
    """Full box of ``shape`` except ``[start, stop)`` along ``dim``."""
    return tuple((start, stop) if d == dim else (0, size) for d, size in enumerate(shape))
