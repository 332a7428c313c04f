"""Transformer Engine FP8 pass-through: Float8Blockwise params are sent as they are.

A Megatron param trained with ``fp8_param`` and the blockwise recipe is a TE
``Float8BlockwiseQTensor``: ``_rowwise_data`` (uint8, logical shape) and
``_rowwise_scale_inv`` (float32, ``(ceil(M/128), round_up_4(ceil(K/128)))``). As Bridge's
``build_export_fp8_tasks`` does, each such task becomes a data task (the bytes viewed as
``float8_e4m3fn``) plus a ``*_scale_inv`` sibling through ``_HFNameSuffixMapping``, with the
scale padding trimmed. Nothing is dequantized or re-quantized: the engine receives TE's own
bytes and scales.

Differences from Bridge, on purpose: tasks are this rank's only (no PP all-gather of FP8
flags), and the trimmed scale is a *view* (``narrow``), not a copy, so the local shard stays
bound to TE's buffers, which the optimizer step re-quantizes in place.
"""

from __future__ import annotations

import dataclasses
import math

from megatron_refit.endpoint.fp8 import FP8_DTYPE
from megatron_refit.plan.fp8_layout import SCALE_SUFFIX, scale_box, weight_name
from megatron_refit.plan.spec import ShardSpec

from conversion.te_shim import import_bridge

import_bridge()
from conversion.bridge_api import SuffixMapping, model_bridge_of  # noqa: E402


def blockwise_fp8_metadata(tensor) -> dict | None:
    """TE's metadata of a 2-D-scaled Float8Blockwise tensor, else None."""
    get_metadata = getattr(tensor, "get_metadata", None)
    if get_metadata is None:
        return None
    meta = get_metadata()
    if meta.get("rowwise_data") is None or meta.get("rowwise_scale_inv") is None:
        return None
    block = getattr(meta.get("quantizer"), "block_len", None)
    if not meta.get("is_2D_scaled") or block is None:
        raise ValueError(
            f"FP8 param of shape {tuple(tensor.shape)} is not 2-D block scaled (block_len={block}, "
            f"is_2D_scaled={meta.get('is_2D_scaled')}): only 128x128 Float8Blockwise weights pass through"
        )
    if block != 128:
        raise ValueError(f"FP8 param of shape {tuple(tensor.shape)} has block_len={block}; engines load 128x128")
    return meta


def pass_through_tasks(model_bridge, tasks: list) -> list:
    """``tasks`` with every Float8Blockwise weight task split into FP8 data + ``_scale_inv`` tasks."""
    registry = model_bridge.mapping_registry()
    out = []
    for task in tasks:
        meta = blockwise_fp8_metadata(task.param_weight)
        if meta is None:
            out.append(task)
            continue
        data = meta["rowwise_data"].view(FP8_DTYPE)
        scale = meta["rowwise_scale_inv"]
        scale = scale.narrow(1, 0, math.ceil(data.shape[-1] / 128))  # TE pads dim 1 to a multiple of 4
        out.append(dataclasses.replace(task, param_weight=data))
        out.append(dataclasses.replace(
            task,
            param_name=task.param_name + SCALE_SUFFIX,
            global_param_name=task.global_param_name + SCALE_SUFFIX,
            param_weight=scale,
            mapping=SuffixMapping(registry.resolve_mapping(task.mapping, ()), SCALE_SUFFIX),
        ))
    return out


def enumerate_te_fp8_shards(bridge, model: list, hf_config) -> list:
    """This rank's local shards with Float8Blockwise weights passed through (data + scales)."""
    from conversion.local_shards import enumerate_local_shards, local_conversion_tasks

    tasks = pass_through_tasks(model_bridge_of(bridge), local_conversion_tasks(bridge, model, hf_config))
    shards = enumerate_local_shards(bridge, model, hf_config, tasks=tasks)
    check_fp8_specs([s.spec for s in shards])
    return shards


def check_fp8_specs(specs: list[ShardSpec]) -> None:
    """Every FP8 weight piece has a scale piece whose tiles are its box ÷ 128, every edge on
    the 128 grid; ``ValueError`` naming parameter, dim and boundary otherwise (a TP split of a
    TE weight off the grid gives per-shard scales that no engine shard can use)."""
    by_name = {s.name: s for s in specs}
    for spec in specs:
        base = weight_name(spec.name)
        if base is None:
            continue
        weight = by_name.get(base)
        if weight is None:
            raise ValueError(f"{spec.name}: scale tiles without the FP8 weight {base!r} on this rank")
        tiles = scale_box(base, weight.box, weight.global_shape)
        if tiles != spec.box:
            raise ValueError(f"{spec.name}: tiles {spec.box} do not cover weight box {weight.box} (expected {tiles})")
    for spec in specs:
        if spec.dtype == "float8_e4m3fn" and spec.name + SCALE_SUFFIX not in by_name:
            raise ValueError(f"{spec.name}: FP8 weight without its {SCALE_SUFFIX} tiles")
