"""The pieces of each HF parameter that every generation rank holds (pure).

``style="vllm"`` follows vLLM's tensor-parallel sharding, decided by the parameter's role
(the last components of its HF name); ``style="full"`` is a receiver that holds every
parameter whole (e.g. Hugging Face transformers at TP1). A replica may be one wide
expert-parallel deployment of data-parallel ranks (``attention_dp``, an expert placement):
:mod:`megatron_refit.plan.deployment`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_refit.plan.deployment import ExpertHolders
from megatron_refit.plan.expert_placement import ExpertPlacement
from megatron_refit.plan.fp8_layout import BLOCK, scale_box, scale_shape, weight_name
from megatron_refit.plan.roles import EXPERT_RE, param_role
from megatron_refit.plan.spec import Box, ShardSpec, box_along, full_box

VOCAB_PADDING = 64
"""vLLM pads the vocabulary of ``VocabParallelEmbedding`` / ``ParallelLMHead`` to this."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GenLayout:
    """Parallel sizes of the generation engine: ``dp`` replicas of one deployment each, a
    deployment ``attention_dp`` data-parallel ranks of ``tp`` tensor-parallel ranks.
    ``gen_rank = replica * deployment_size + dp_rank * tp + tp_rank`` (``dp_index * tp + tp_rank``
    where ``attention_dp`` is 1)."""

    tp: int = 1
    """Tensor-parallel size inside one deployment (of its attention)."""
    dp: int = 1
    """Number of engine replicas."""
    expert_parallel: bool = False
    """vLLM ``enable_expert_parallel``: routed experts split whole over the deployment's ranks."""
    attention_dp: int = 1
    """Data-parallel ranks inside one deployment (vLLM ``--data-parallel-size``, SGLang ``--dp``
    with ``--enable-dp-attention``): attention is replicated over them, the routed experts spread
    over all ``tp * attention_dp`` ranks. In a dense model (``num_experts`` 0) they hold the same
    pieces as replicas would: :func:`gen_targets` plans them as ``dp * attention_dp`` replicas."""
    placement: ExpertPlacement | None = None
    """The physical expert slots under ``expert_parallel`` (EP size ``tp * attention_dp``); None:
    vLLM's initial linear map with no redundant experts (where ``attention_dp`` is 1 too: each
    TP rank holds ``num_experts // tp`` consecutive experts, as before)."""

    def __post_init__(self) -> None:
        for axis in ("tp", "dp", "attention_dp"):
            value = getattr(self, axis)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GenLayout.{axis} must be a positive int, got {value!r}")
        if self.placement is not None:
            if not isinstance(self.placement, ExpertPlacement):
                raise ValueError(f"GenLayout.placement must be an ExpertPlacement or None, got {self.placement!r}")
            if not self.expert_parallel:
                raise ValueError("GenLayout.placement places experts under expert parallelism: set "
                                 "expert_parallel=True")
            if self.placement.ep_size != self.deployment_size:
                raise ValueError(f"GenLayout.placement.ep_size={self.placement.ep_size} is not the deployment's "
                                 f"tp * attention_dp = {self.tp} * {self.attention_dp}")

    @property
    def deployment_size(self) -> int:
        """Ranks of one deployment (one replica): ``tp * attention_dp``."""
        return self.tp * self.attention_dp

    @property
    def world_size(self) -> int:
        return self.deployment_size * self.dp


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
    """Every class of engine ranks' box of every HF parameter, without a ShardSpec per piece: the
    compact form of :func:`gen_target_classes`, which a full-scale dry run plans from."""

    ranks: tuple[tuple[int, ...], ...]
    """Gen ranks of each class: class ``i`` is rank ``i`` of a deployment (its TP rank where
    ``attention_dp`` is 1, or the model is dense) and the same rank of the other replicas."""
    params: dict[str, tuple[tuple[int, ...], str, tuple[Box | None, ...]]]
    """``{HF name: (global shape, dtype, box per class, None where a class holds none of it)}``,
    in the order :func:`gen_target_classes` lists them; parameters of one role and shape share
    one tuple of boxes."""


def _deployment_boxes(name: str, shape: tuple[int, ...], layout: GenLayout, flat: GenLayout, model: ModelShape,
                      role: str) -> tuple[Box | None, ...]:
    """Per deployment rank ``i``: routed experts without expert parallelism sharded over the whole
    deployment at ``i`` (vLLM's flattened MoE TP), every other parameter at TP rank ``i % tp``."""
    if role in ("expert_column", "expert_row"):
        return tuple(_vllm_box(name, shape, flat, i, model, role) for i in range(flat.tp))
    return tuple(_vllm_box(name, shape, layout, tp_rank, model, role) for tp_rank in range(layout.tp)) * \
        layout.attention_dp


def deployment_placement(layout: GenLayout, num_experts: int) -> ExpertPlacement | None:
    """The placement whole routed experts follow on the ranks of a wide deployment: ``layout``'s
    own, or vLLM's initial linear map over the deployment where ``attention_dp > 1``; None where
    there are no whole experts to place or each TP rank holds ``num_experts // tp`` consecutive
    ones (no placement given, ``attention_dp`` 1)."""
    if not (layout.expert_parallel and num_experts):
        return None
    if layout.placement is not None:
        return layout.placement
    if layout.attention_dp > 1:
        return ExpertPlacement(num_logical_experts=num_experts, ep_size=layout.deployment_size)
    return None


def gen_targets(
    params: dict[str, tuple[tuple[int, ...], str]],
    layout: GenLayout,
    model: ModelShape,
    *,
    style: str = "vllm",
) -> GenTargets:
    """The box of every parameter on every class of engine ranks; ``params`` maps every HF
    parameter name to ``(global_shape, dtype)``.

    One class per TP rank, its replicas' ranks with it; a deployment of ``attention_dp > 1`` or
    with an expert ``placement`` (a MoE model): one class per deployment rank ``i`` (the gen ranks
    ``replica * deployment_size + i``), the dense parameters at TP rank ``i % tp``, each routed
    expert whole on the ranks that hold a slot of it in its MoE layer
    (:class:`~megatron_refit.plan.deployment.ExpertHolders`: once per rank however many of its
    slots hold it), or without expert parallelism sharded over the deployment at ``i``."""
    if style == "full":
        if layout.tp != 1:
            raise ValueError(f"style='full' holds every parameter whole and needs tp=1, got tp={layout.tp}")
        if layout.attention_dp != 1:
            raise ValueError(f"style='full' holds every parameter whole on every rank, with no data-parallel ranks "
                             f"inside a replica: attention_dp must be 1, got {layout.attention_dp}")
    elif style != "vllm":
        raise ValueError(f"unknown gen style {style!r}; expected 'vllm' or 'full'")
    placement = layout.placement
    if placement is not None and placement.num_logical_experts != model.num_experts:
        raise ValueError(f"GenLayout.placement has num_logical_experts={placement.num_logical_experts}, the model "
                         f"num_experts={model.num_experts}")
    if layout.attention_dp > 1 and model.num_experts == 0:  # dense: its DP ranks hold what replicas would
        layout = GenLayout(tp=layout.tp, dp=layout.dp * layout.attention_dp, expert_parallel=layout.expert_parallel)
    placement = deployment_placement(layout, model.num_experts) if style == "vllm" else None
    wide = style == "vllm" and (layout.attention_dp > 1 or placement is not None)
    flat = GenLayout(tp=layout.deployment_size)
    out: dict[str, tuple[tuple[int, ...], str, tuple[Box | None, ...]] | None] = {}
    # Boxes depend on (role, shape) only, except whole experts under expert parallelism:
    # computed once per (role, shape), and the box objects shared (thousands of experts).
    memo: dict[tuple[str, tuple[int, ...]], tuple[Box | None, ...]] = {}
    roles: dict[str, str] = {}  # by name with the expert index blanked: experts of a layer share a role
    scales = []
    experts = []  # wide expert parallelism: whole experts, placed once every MoE layer is known
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
        if key is None and wide:
            experts.append((name, shape, dtype, name[: expert.start("expert")], int(expert.group("expert"))))
            out[name] = None  # its place in the order kept
            continue
        per_rank = memo.get(key) if key is not None else None
        if per_rank is None:
            if wide:
                per_rank = _deployment_boxes(name, shape, layout, flat, model, role)
            else:
                per_rank = tuple(_vllm_box(name, shape, layout, tp_rank, model, role) for tp_rank in range(layout.tp))
            if key is not None:
                memo[key] = per_rank
        out[name] = (shape, dtype, per_rank)
    if experts:
        holders = ExpertHolders(placement, {prefix for *_, prefix, _ in experts})
        placed: dict[tuple, tuple[Box | None, ...]] = {}  # by (shape, ranks): experts of one shape share boxes
        for name, shape, dtype, prefix, index in experts:
            per_expert = holders.of_layer(prefix)
            if index >= len(per_expert):
                raise ValueError(f"{name}: expert {index} out of range for num_experts={model.num_experts}")
            ranks = per_expert[index]
            boxes = placed.get((shape, ranks))
            if boxes is None:
                whole = full_box(shape)
                boxes = placed[shape, ranks] = tuple(whole if i in ranks else None
                                                     for i in range(layout.deployment_size))
            out[name] = (shape, dtype, boxes)
    tiles: dict = {}
    for name, shape, dtype in scales:  # FP8 *_scale_inv tiles follow their weight's boxes
        out[name] = (shape, dtype, _scale_boxes(name, shape, params, out, tiles))
    size = layout.deployment_size if wide else layout.tp
    ranks = tuple(tuple(replica * size + i for replica in range(layout.dp)) for i in range(size))
    return GenTargets(ranks=ranks, params=out)


def gen_target_classes(
    params: dict[str, tuple[tuple[int, ...], str]],
    layout: GenLayout,
    model: ModelShape,
    *,
    style: str = "vllm",
) -> list[tuple[tuple[int, ...], list[ShardSpec]]]:
    """The ShardSpecs per class of engine ranks and the gen ranks that hold them (a TP rank's, or
    a deployment rank's, in every replica: :func:`gen_targets`).

    ``params`` maps every HF parameter name to ``(global_shape, dtype)``.
    """
    targets = gen_targets(params, layout, model, style=style)
    per_class: list[list[ShardSpec]] = [[] for _ in targets.ranks]
    trusted = ShardSpec.trusted
    for name, (shape, dtype, boxes) in targets.params.items():
        is_expert = EXPERT_RE.search(name) is not None
        for specs, box in zip(per_class, boxes):
            if box is not None:
                specs.append(trusted(name, shape, dtype, box, is_expert=is_expert))
    return list(zip(targets.ranks, per_class))


def gen_rank_specs(params: dict[str, tuple[tuple[int, ...], str]], layout: GenLayout, model: ModelShape,
                   gen_index: int, *, style: str = "vllm") -> list[ShardSpec]:
    """The ShardSpecs engine rank ``gen_index`` must hold: :func:`gen_target_specs`' entry for it,
    without making every other class's (an engine rank's own storage, built again when its
    experts move)."""
    targets = gen_targets(params, layout, model, style=style)
    which = next((c for c, ranks in enumerate(targets.ranks) if gen_index in ranks), None)
    if which is None:
        raise ValueError(f"gen rank {gen_index} is not one of the layout's {layout.world_size} ranks")
    trusted = ShardSpec.trusted
    return [trusted(name, shape, dtype, boxes[which], is_expert=EXPERT_RE.search(name) is not None)
            for name, (shape, dtype, boxes) in targets.params.items() if boxes[which] is not None]


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
