"""The pieces of each HF parameter that every generation rank holds (pure).

``style="vllm"`` follows vLLM's tensor-parallel sharding, decided by the parameter's role
(the last components of its HF name); ``style="full"`` is a receiver that holds every
parameter whole (e.g. Hugging Face transformers at TP1).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from megatron_refit.fp8 import BLOCK, scale_box, scale_shape, weight_name
from megatron_refit.spec import Box, ShardSpec, box_along, full_box

VOCAB_PADDING = 64
"""vLLM pads the vocabulary of ``VocabParallelEmbedding`` / ``ParallelLMHead`` to this."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GenLayout:
    """Parallel sizes of the generation engine. ``gen_rank = dp_index * tp + tp_rank``."""

    tp: int = 1
    """Tensor-parallel size of one engine replica."""
    dp: int = 1
    """Number of engine replicas."""
    expert_parallel: bool = False
    """vLLM ``enable_expert_parallel``: routed experts split whole over the TP ranks."""

    def __post_init__(self) -> None:
        for axis in ("tp", "dp"):
            value = getattr(self, axis)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GenLayout.{axis} must be a positive int, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.dp


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """The model sizes that the sharding rules need."""

    num_attention_heads: int
    num_kv_heads: int
    vocab_size: int
    """Unpadded vocabulary size (rows of ``embed_tokens`` / ``lm_head``)."""
    num_experts: int = 0
    """Routed experts per MoE layer; 0 for a dense model."""

    def __post_init__(self) -> None:
        for field in ("num_attention_heads", "num_kv_heads", "vocab_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelShape.{field} must be a positive int, got {value!r}")
        if not isinstance(self.num_experts, int) or self.num_experts < 0:
            raise ValueError(f"ModelShape.num_experts must be a non-negative int, got {self.num_experts!r}")


_EXPERT = r"(?:^|\.)mlp\.experts\.(?P<expert>\d+)\."
_SHARED = r"(?:^|\.)mlp\.shared_experts?\."
_ROLES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (role, re.compile(pattern))
    for role, pattern in (
        ("q", r"(?:^|\.)self_attn\.q_proj\.(?:weight|bias)$"),
        ("kv", r"(?:^|\.)self_attn\.[kv]_proj\.(?:weight|bias)$"),
        # MLA (DeepSeek): per-head up projections are column-parallel by heads; the low-rank
        # down projections (vLLM fuses them into ``fused_qkv_a_proj``) are replicated.
        ("q", r"(?:^|\.)self_attn\.(?:q_b|kv_b)_proj\.weight$"),
        ("replicated", r"(?:^|\.)self_attn\.(?:q_a_proj|kv_a_proj_with_mqa)\.weight$"),
        ("column", r"(?:^|\.)mlp\.(?:gate|up)_proj\.(?:weight|bias)$"),
        ("column", _SHARED + r"(?:gate|up)_proj\.(?:weight|bias)$"),
        ("expert_column", _EXPERT + r"(?:gate|up)_proj\.(?:weight|bias)$"),
        ("row", r"(?:^|\.)self_attn\.o_proj\.weight$"),
        ("row", r"(?:^|\.)mlp\.down_proj\.weight$"),
        ("row", _SHARED + r"down_proj\.weight$"),
        ("expert_row", _EXPERT + r"down_proj\.weight$"),
        ("expert_replicated", _EXPERT + r"down_proj\.bias$"),
        ("vocab", r"(?:^|\.)embed_tokens\.weight$"),
        ("vocab", r"^lm_head\.weight$"),
        # Replicated parameters of 2 or more dims; any other 1-D parameter is replicated too.
        ("replicated", r"(?:^|\.)mlp\.gate\.weight$"),  # MoE router
        ("replicated", r"(?:^|\.)mlp\.shared_expert_gate\.weight$"),
    )
)


def param_role(name: str, ndim: int) -> str:
    """Sharding role of HF parameter ``name``; ``ValueError`` for an unknown tensor of 2+ dims."""
    for role, pattern in _ROLES:
        if pattern.search(name):
            return role
    if ndim <= 1:
        return "replicated"
    raise ValueError(f"no vLLM sharding rule for parameter {name!r} ({ndim} dims)")


def _even(name: str, size: int, num_shards: int, index: int) -> tuple[int, int]:
    if size % num_shards:
        raise ValueError(f"{name}: dim of size {size} is not divisible by tp={num_shards}")
    step = size // num_shards
    return index * step, (index + 1) * step


def _q_rows(name: str, rows: int, tp: int, tp_rank: int, model: ModelShape) -> tuple[int, int]:
    heads = model.num_attention_heads
    if heads % tp:
        raise ValueError(f"{name}: num_attention_heads={heads} is not divisible by tp={tp}")
    if rows % heads:
        raise ValueError(f"{name}: {rows} rows are not a multiple of num_attention_heads={heads}")
    return _even(name, rows, tp, tp_rank)


def _kv_rows(name: str, rows: int, tp: int, tp_rank: int, model: ModelShape) -> tuple[int, int]:
    kv = model.num_kv_heads
    if rows % kv:
        raise ValueError(f"{name}: {rows} rows are not a multiple of num_kv_heads={kv}")
    head_dim = rows // kv
    if tp <= kv:
        if kv % tp:
            raise ValueError(f"{name}: num_kv_heads={kv} is not divisible by tp={tp}")
        per_rank = kv // tp
        return tp_rank * per_rank * head_dim, (tp_rank + 1) * per_rank * head_dim
    if tp % kv:
        raise ValueError(f"{name}: tp={tp} is not a multiple of num_kv_heads={kv} (KV heads cannot be replicated)")
    head = tp_rank // (tp // kv)
    return head * head_dim, (head + 1) * head_dim


def _vocab_rows(name: str, rows: int, tp: int, tp_rank: int, model: ModelShape) -> tuple[int, int] | None:
    if rows != model.vocab_size:
        raise ValueError(f"{name}: {rows} rows but vocab_size={model.vocab_size}")
    padded = math.ceil(rows / VOCAB_PADDING) * VOCAB_PADDING
    if padded % tp:
        raise ValueError(f"{name}: padded vocab {padded} is not divisible by tp={tp}")
    per_rank = padded // tp
    start, stop = tp_rank * per_rank, min((tp_rank + 1) * per_rank, rows)
    return (start, stop) if start < stop else None


def _expert_owner(name: str, tp: int, model: ModelShape) -> int:
    """The TP rank that holds expert ``name`` whole under expert parallelism."""
    expert = int(re.search(_EXPERT, name).group("expert"))
    if model.num_experts % tp or model.num_experts == 0:
        raise ValueError(f"{name}: num_experts={model.num_experts} is not a positive multiple of tp={tp}")
    if expert >= model.num_experts:
        raise ValueError(f"{name}: expert {expert} out of range for num_experts={model.num_experts}")
    return expert // (model.num_experts // tp)


def _vllm_box(name: str, shape: tuple[int, ...], layout: GenLayout, tp_rank: int, model: ModelShape) -> Box | None:
    """The box of ``name`` held by ``tp_rank``, or None if that rank holds none of it."""
    role = param_role(name, len(shape))
    tp = layout.tp
    if role.startswith("expert_") and layout.expert_parallel:
        return full_box(shape) if _expert_owner(name, tp, model) == tp_rank else None
    if role == "expert_replicated":
        role = "replicated"
    if role == "replicated" or tp == 1:
        return full_box(shape)
    if role == "q":
        rows = _q_rows(name, shape[0], tp, tp_rank, model)
    elif role == "kv":
        rows = _kv_rows(name, shape[0], tp, tp_rank, model)
    elif role == "vocab":
        rows = _vocab_rows(name, shape[0], tp, tp_rank, model)
        if rows is None:
            return None
    elif role in ("column", "expert_column"):
        rows = _even(name, shape[0], tp, tp_rank)
    else:
        assert role in ("row", "expert_row"), role
        return box_along(shape, 1, *_even(name, shape[1], tp, tp_rank))
    return box_along(shape, 0, *rows)


def _add_scale_boxes(params: dict, boxes: dict[str, Box | None]) -> None:
    """FP8 ``*_scale_inv`` tiles: the weight's box ÷ 128, its edges on block edges."""
    for name, (shape, _) in params.items():
        weight = weight_name(name)
        if weight is None:
            continue
        if weight not in params:
            raise ValueError(f"{name}: FP8 scale without its weight {weight!r} in the parameter table")
        if tuple(shape) != scale_shape(tuple(params[weight][0])):
            raise ValueError(
                f"{name}: shape {tuple(shape)} is not that of {BLOCK}x{BLOCK} blocks of {weight} "
                f"{tuple(params[weight][0])} (expected {scale_shape(tuple(params[weight][0]))})"
            )
        box = boxes[weight]
        boxes[name] = None if box is None else scale_box(weight, box, tuple(params[weight][0]))


def gen_target_specs(
    params: dict[str, tuple[tuple[int, ...], str]],
    layout: GenLayout,
    model: ModelShape,
    *,
    style: str = "vllm",
) -> dict[int, list[ShardSpec]]:
    """The ShardSpecs each generation rank must hold, keyed by gen rank.

    ``params`` maps every HF parameter name to ``(global_shape, dtype)``; an FP8 table
    (:func:`megatron_refit.fp8.fp8_param_table`) adds ``*_scale_inv`` tiles, whose boxes
    follow their weight's (``ValueError`` where a shard edge is off the 128 grid).
    """
    if style == "full":
        if layout.tp != 1:
            raise ValueError(f"style='full' holds every parameter whole and needs tp=1, got tp={layout.tp}")
        boxes = [{name: full_box(tuple(shape)) for name, (shape, _) in params.items()}]
    elif style == "vllm":
        boxes = [
            {name: _vllm_box(name, tuple(shape), layout, tp_rank, model)
             for name, (shape, _) in params.items() if weight_name(name) is None}
            for tp_rank in range(layout.tp)
        ]
    else:
        raise ValueError(f"unknown gen style {style!r}; expected 'vllm' or 'full'")
    for rank_boxes in boxes:
        _add_scale_boxes(params, rank_boxes)
    per_tp_rank = [
        [
            ShardSpec(
                name=name,
                global_shape=tuple(params[name][0]),
                dtype=params[name][1],
                box=box,
                is_expert=re.search(_EXPERT, name) is not None,
            )
            for name, box in rank_boxes.items()
            if box is not None
        ]
        for rank_boxes in boxes
    ]
    return {
        dp_index * layout.tp + tp_rank: list(per_tp_rank[tp_rank])
        for dp_index in range(layout.dp)
        for tp_rank in range(layout.tp)
    }
