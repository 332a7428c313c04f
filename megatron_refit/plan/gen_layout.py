"""The pieces of each HF parameter that every generation rank holds (pure).

``style="vllm"`` follows vLLM's tensor-parallel sharding, decided by the parameter's role
(the last components of its HF name); ``style="full"`` is a receiver that holds every
parameter whole (e.g. Hugging Face transformers at TP1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_refit.plan.fp8_layout import BLOCK, scale_box, scale_shape, weight_name
from megatron_refit.plan.roles import EXPERT_RE, param_role
from megatron_refit.plan.spec import Box, ShardSpec, box_along, full_box

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
    expert = int(EXPERT_RE.search(name).group("expert"))
    if model.num_experts % tp or model.num_experts == 0:
        raise ValueError(f"{name}: num_experts={model.num_experts} is not a positive multiple of tp={tp}")
    if expert >= model.num_experts:
        raise ValueError(f"{name}: expert {expert} out of range for num_experts={model.num_experts}")
    return expert // (model.num_experts // tp)


def _vllm_box(
    name: str, shape: tuple[int, ...], layout: GenLayout, tp_rank: int, model: ModelShape, role: str | None = None
) -> Box | None:
    """The box of ``name`` held by ``tp_rank``, or None if that rank holds none of it."""
    role = role or param_role(name, len(shape))
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
    elif role in ("row", "expert_row"):
        return box_along(shape, 1, *_even(name, shape[1], tp, tp_rank))
    else:
        raise ValueError(f"{name}: unknown sharding role {role!r}")
    return box_along(shape, 0, *rows)


def _scale_boxes(name: str, shape: tuple[int, ...], params: dict, targets: dict,
                 memo: dict | None = None) -> tuple[Box | None, ...]:
    """An FP8 ``*_scale_inv``'s tiles per TP rank: the weight's box ÷ 128, every edge of the
    weight's box on the 128 grid (``ValueError`` naming parameter, dim and boundary). ``memo``:
    by weights' shared tuple of boxes (parameters of one role and shape share one), computed once."""
    weight = weight_name(name)
    if weight not in params:
        raise ValueError(f"{name}: FP8 scale without its weight {weight!r} in the parameter table")
    weight_shape = tuple(params[weight][0])
    if shape != scale_shape(weight_shape):
        raise ValueError(f"{name}: shape {shape} is not that of {BLOCK}x{BLOCK} blocks of {weight} {weight_shape} "
                         f"(expected {scale_shape(weight_shape)})")
    boxes = targets[weight][2]
    key = (id(boxes), weight_shape)
    if memo is not None and key in memo:
        return memo[key][1]
    out = tuple(None if box is None else scale_box(weight, box, weight_shape) for box in boxes)
    if memo is not None:
        memo[key] = (boxes, out)  # the boxes kept alive: their id stays theirs
    return out


@dataclass(frozen=True, slots=True)
class GenTargets:
    """Every engine TP rank's box of every HF parameter, without a ShardSpec per piece: the
    compact form of :func:`gen_target_classes`, which a full-scale dry run plans from."""

    ranks: tuple[tuple[int, ...], ...]
    """Gen ranks of each class: class ``i`` is engine TP rank ``i`` and its DP replicas."""
    params: dict[str, tuple[tuple[int, ...], str, tuple[Box | None, ...]]]
    """``{HF name: (global shape, dtype, box per class, None where a class holds none of it)}``,
    in the order :func:`gen_target_classes` lists them; parameters of one role and shape share
    one tuple of boxes."""


def gen_targets(
    params: dict[str, tuple[tuple[int, ...], str]],
    layout: GenLayout,
    model: ModelShape,
    *,
    style: str = "vllm",
) -> GenTargets:
    """The box of every parameter on every engine TP rank; ``params`` maps every HF
    parameter name to ``(global_shape, dtype)``."""
    if style == "full":
        if layout.tp != 1:
            raise ValueError(f"style='full' holds every parameter whole and needs tp=1, got tp={layout.tp}")
    elif style != "vllm":
        raise ValueError(f"unknown gen style {style!r}; expected 'vllm' or 'full'")
    out: dict[str, tuple[tuple[int, ...], str, tuple[Box | None, ...]]] = {}
    # Boxes depend on (role, shape) only, except whole experts under expert parallelism:
    # computed once per (role, shape), and the box objects shared (thousands of experts).
    memo: dict[tuple[str, tuple[int, ...]], tuple[Box | None, ...]] = {}
    roles: dict[str, str] = {}  # by name with the expert index blanked: experts of a layer share a role
    scales = []
    for name, (shape, dtype) in sorted(params.items()):
        shape = tuple(shape)
        if weight_name(name) is not None:
            scales.append((name, shape, dtype))
            continue
        if style == "full":
            out[name] = (shape, dtype, (full_box(shape),))
            continue
        expert = EXPERT_RE.search(name)
        template = name if expert is None else f"{name[: expert.start('expert')]}#{name[expert.end('expert'):]}"
        role = roles.get(template)
        if role is None:
            role = roles[template] = param_role(name, len(shape))
        key = None if role.startswith("expert_") and layout.expert_parallel else (role, shape)
        per_rank = memo.get(key) if key is not None else None
        if per_rank is None:
            per_rank = tuple(_vllm_box(name, shape, layout, tp_rank, model, role) for tp_rank in range(layout.tp))
            if key is not None:
                memo[key] = per_rank
        out[name] = (shape, dtype, per_rank)
    tiles: dict = {}
    for name, shape, dtype in scales:  # FP8 *_scale_inv tiles follow their weight's boxes
        out[name] = (shape, dtype, _scale_boxes(name, shape, params, out, tiles))
    ranks = tuple(tuple(dp_index * layout.tp + tp_rank for dp_index in range(layout.dp))
                  for tp_rank in range(layout.tp))
    return GenTargets(ranks=ranks, params=out)


def gen_target_classes(
    params: dict[str, tuple[tuple[int, ...], str]],
    layout: GenLayout,
    model: ModelShape,
    *,
    style: str = "vllm",
) -> list[tuple[tuple[int, ...], list[ShardSpec]]]:
    """The ShardSpecs per engine TP rank and the gen ranks (its DP replicas) that hold them.

    ``params`` maps every HF parameter name to ``(global_shape, dtype)``.
    """
    targets = gen_targets(params, layout, model, style=style)
    per_tp_rank: list[list[ShardSpec]] = [[] for _ in targets.ranks]
    trusted = ShardSpec.trusted
    for name, (shape, dtype, boxes) in targets.params.items():
        is_expert = EXPERT_RE.search(name) is not None
        for specs, box in zip(per_tp_rank, boxes):
            if box is not None:
                specs.append(trusted(name, shape, dtype, box, is_expert=is_expert))
    return list(zip(targets.ranks, per_tp_rank))


def gen_target_specs(
    params: dict[str, tuple[tuple[int, ...], str]],
    layout: GenLayout,
    model: ModelShape,
    *,
    style: str = "vllm",
) -> dict[int, list[ShardSpec]]:
    """The ShardSpecs each generation rank must hold, keyed by gen rank (see
    :func:`gen_target_classes`)."""
    by_rank = {
        rank: list(specs)
        for ranks, specs in gen_target_classes(params, layout, model, style=style)
        for rank in ranks
    }
    return dict(sorted(by_rank.items()))
