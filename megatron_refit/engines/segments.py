"""Segmented tensors, one implementation for every engine.

A family's ``segments`` (:attr:`megatron_refit.families.base.ModelFamily.segments`) name HF
tensors that are a concatenation along dim 0 of parts sharded on their own (Mamba's
``in_proj`` = [z, x, B, C, dt]); each part travels as ``<name>#<segment>``
(:func:`megatron_refit.families.segment_name`). An engine that holds the whole tensor joins
them (:func:`join_segments`); checks that compare with whole tensors split them
(:func:`split_segments`).
"""

from __future__ import annotations

import torch

from megatron_refit import families


def split_segments(tensors: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Whole HF tensors with their segments added as ``<name>#<segment>`` views (dim 0), given
    every segment's global shape (``shapes``, refit names)."""
    out = dict(tensors)
    for name, t in tensors.items():
        order = families.segment_order(name)
        if order is None:
            continue
        start = 0
        for segment in order:
            rows = shapes[families.segment_name(name, segment)][0]
            out[families.segment_name(name, segment)] = t.narrow(0, start, rows)
            start += rows
    return out


def join_segments(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``<name>#<segment>`` tensors concatenated back into ``<name>`` (dim 0, in the family's
    segment order), the others as they are; ``ValueError`` naming a tensor whose segments are
    not all there."""
    out: dict[str, torch.Tensor | None] = {}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        base, segment = families.split_segment(name)
        if segment is None:
            out[name] = t
        else:
            parts.setdefault(base, {})[segment] = t
            out.setdefault(base, None)
    for base, members in parts.items():
        order = families.segment_order(base) or ()
        if set(order) != set(members):
            raise ValueError(f"{base}: segments {sorted(members)} received, the family's are {list(order)}")
        out[base] = torch.cat([members[segment] for segment in order])
    return out
