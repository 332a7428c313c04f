"""The expert placement a vLLM worker receives into, checked against vLLM's own (imports no vLLM).

vLLM computes each FusedMoE layer's ``expert_map`` (global physical slot -> local index, -1
elsewhere) with its own rules (``determine_expert_map``: strategy, fallbacks, DP x TP
flattening). The plan computes the same from the ``refit:`` section
(:func:`~megatron_refit.config.deployment.deployment_layout`). :func:`check_expert_maps` holds
every layer of the live model to the plan's map, and refuses by name, before any byte moves,
where they differ: a refit into slots the engine does not hold would serve wrong experts.
"""

from __future__ import annotations

import torch

from megatron_refit.plan.expert_placement import ExpertPlacement, expert_map


def moe_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules that hold a layer's routed experts (``w13_weight`` and vLLM's ``expert_map``),
    in model order: one per MoE layer."""
    return [(name, module) for name, module in model.named_modules()
            if hasattr(module, "w13_weight") and hasattr(module, "expert_map")]


def check_expert_maps(model: torch.nn.Module, placement: ExpertPlacement, ep_rank: int) -> int:
    """``ValueError`` naming the first MoE layer whose vLLM ``expert_map`` on this rank is not the
    plan's for deployment rank ``ep_rank``, or whose local expert count differs; the number of
    layers checked. vLLM keeps no map at EP size 1 (every slot local)."""
    want = expert_map(placement, ep_rank)
    layers = moe_modules(model)
    if not layers:
        raise ValueError("the vLLM model has no FusedMoE layer (w13_weight with an expert_map) to check the "
                         "expert placement against")
    for name, module in layers:
        have = module.expert_map
        have = tuple(range(placement.num_physical)) if have is None else tuple(int(x) for x in have.tolist())
        if have[: len(want)] != want or any(x != -1 for x in have[len(want):]):
            raise ValueError(f"{name}: vLLM's expert_map on deployment rank {ep_rank} is {list(have)[:16]}, the "
                             f"refit plans {list(want)[:16]} ({placement.strategy} over EP{placement.ep_size}, "
                             f"{placement.num_redundant} redundant experts): the refit: section and the engine "
                             "disagree (gen_tp, gen_attention_dp, gen_expert_placement)")
        local = sum(1 for x in want if x >= 0)
        if module.w13_weight.shape[0] != local:
            raise ValueError(f"{name}: w13_weight holds {module.w13_weight.shape[0]} experts on deployment rank "
                             f"{ep_rank}, the expert map {local}")
    return len(layers)
