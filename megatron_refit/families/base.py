"""What a model family is: one table of everything family-specific (pure data, no Megatron).

The runtime (sender plan, generation layout, receivers) and the tooling ask these tables
through :mod:`megatron_refit.families`; no other module names a family's parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

QUANTISED_ROLES = frozenset({"q", "kv", "column", "expert_column", "row", "expert_row"})
"""Default: the sharding roles of the linear weights trainer-side FP8 quantizes (q/k/v/o and
gate/up/down, routed and shared experts included). Embeddings and lm_head (``vocab``), norms,
the MoE router and biases keep their training dtype."""

ADAPTED_ROLES = frozenset({"q", "kv", "column", "row"})
"""Default: the roles of the dense projections LoRA wraps (linear_qkv, linear_proj, linear_fc1,
linear_fc2); routed experts are not adapted."""

SEGMENT_MARK = "#"
"""``<HF name>#<segment>``: one segment of an HF tensor that is a concatenation along dim 0
(see :attr:`ModelFamily.segments`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelFamily:
    """Everything that differs between model families."""

    name: str
    architectures: Mapping[str, str]
    """HF architecture -> the transformers config class that builds it."""
    presets: Mapping[str, dict[str, Any]]
    """Model presets (HF config fields): tiny ones for tests and the demo, published shapes
    for dry runs and the cost model."""
    demo: tuple[str, ...]
    """The tiny presets (CPU: tests, ``python -m megatron_refit.demo --model``)."""
    roles: tuple[tuple[str, str], ...]
    """``(role, regex)`` on HF names: how vLLM shards each parameter (see :mod:`megatron_refit.plan.roles`).
    1-D parameters no rule names are replicated."""
    expert_prefix: str
    """Regex of the module path that holds routed experts ``<prefix>.<e>.`` (e.g. ``mlp\\.experts``)."""
    engine_experts: str
    """Regex with groups ``p`` (prefix), ``e`` (expert), ``m`` (projection), ``t`` (tensor):
    the routed-expert weights vLLM stacks into FusedMoE's ``w13_*`` / ``w2_*``."""
    engine_fused: tuple[tuple[str, str, tuple[str, ...]], ...]
    """``(regex with groups p/m/t, fused vLLM name template, member order)``: projections vLLM
    keeps as one tensor, members stacked along dim 0 in this order."""
    vocab: tuple[str, ...]
    """HF names of the vocab-parallel tensors (embedding, lm_head)."""
    segments: tuple[tuple[str, tuple[str, ...], Callable[[Any], tuple[int, ...]]], ...] = ()
    """``(regex on an HF name, segments, hf_config -> rows of each)``: tensors that are a
    concatenation of segments along dim 0, each sharded on its own (Mamba's ``in_proj`` =
    [z, x, B, C, dt]). Refits move ``<name>#<segment>``; a tensor-parallel rank's piece of the
    tensor is one box per segment."""
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    """``(regex, replacement)`` turning a transformers model's state-dict name into the
    checkpoint's (Bridge's export) name."""
    engine_renames: tuple[tuple[str, str], ...] = ()
    """``(regex, replacement)`` turning an HF name into the engine's (after fusing)."""
    engine_transforms: tuple[tuple[str, str, str], ...] = ()
    """``(regex on the engine name, replacement, transform)``: parameters the engine stores
    transformed; the receiver stages the sent bytes and writes the transform at the end of
    a refit (``"neg_exp_fp32"``: Mamba's ``A = -exp(A_log.float())``, kept in float32)."""
    engine_aliases: tuple[tuple[str, tuple[str, ...]], ...] = (
        (".experts.w13_weight", (".experts.w13_weight", ".experts.routed_experts.w13_weight")),
        (".experts.w2_weight", (".experts.w2_weight", ".experts.routed_experts.w2_weight")),
        (".experts.w13_weight_scale_inv", (".experts.w13_weight_scale_inv",
                                           ".experts.routed_experts.w13_weight_scale_inv")),
        (".experts.w2_weight_scale_inv", (".experts.w2_weight_scale_inv",
                                          ".experts.routed_experts.w2_weight_scale_inv")),
    )
    """``(suffix, spellings)``: the names under which vLLM model classes keep a parameter."""
    quantized_roles: frozenset[str] = QUANTISED_ROLES
    adapted_roles: frozenset[str] = ADAPTED_ROLES
    build: str | None = None
    """Module (Megatron side) with ``configure_provider(provider, *, meta)`` for a CPU build,
    or None when Bridge's local layer spec builds the family as it is."""
    layout_checks: Callable[[Any], list[tuple[str, int, str]]] = field(default=lambda cfg: [])
    """``hf_config -> [(field, size, train axis)]``: sizes a train layout must divide beyond the
    ones every family has."""
