"""The expert placement an SGLang worker receives into, checked against SGLang's own (imports no SGLang).

SGLang 0.5.23 places each MoE layer's physical expert slots itself: its ``FusedMoE`` holds
``num_local_experts`` of the ``num_experts`` (``E + R``) slots, from ``moe_ep_rank *
num_local_experts`` on (``_map_global_expert_id_to_local_expert_id``), and the server's
``ExpertLocationMetadata`` (``get_global_expert_location_metadata()``: ``--init-expert-location``,
trivial by default) says which logical expert each slot holds, per decoder layer
(``physical_to_logical_map_cpu``); its weight loader writes a checkpoint expert into the slots
that map names. The plan computes the same from the ``refit:`` section
(:func:`~megatron_refit.config.deployment.deployment_layout`), or reads SGLang's map in force
where it moves or holds redundant experts (:mod:`~megatron_refit.engines.sglang.worker.eplb_map`;
the plan's maps are per MoE layer, in layer order: :func:`moe_layer_ids`).
:func:`check_expert_location` holds every layer of the live model to the plan's slots and refuses by
name, before any byte moves, where they differ: a refit into slots the engine does not hold would
serve wrong experts.
"""

from __future__ import annotations

import torch

from megatron_refit.plan.expert_placement import ExpertPlacement, rank_slots, slots_of


def moe_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """SGLang's ``FusedMoE`` modules (``w13_weight``, ``moe_ep_rank``, ``layer_id``), in model order;
    ``ValueError`` where there is none."""
    layers = [(name, module) for name, module in model.named_modules()
              if hasattr(module, "w13_weight") and hasattr(module, "moe_ep_rank") and hasattr(module, "layer_id")]
    if not layers:
        raise ValueError("the SGLang model has no FusedMoE layer (w13_weight with a moe_ep_rank) to check the "
                         "expert placement against")
    return layers


def moe_layer_ids(model: torch.nn.Module) -> list[int]:
    """The decoder layer ids of ``model``'s FusedMoE layers, ascending: MoE layer ``i`` (the index
    the plan's maps are read at, :mod:`megatron_refit.plan.deployment`) is decoder layer ``[i]``."""
    return sorted({int(module.layer_id) for _, module in moe_modules(model)})


def check_expert_location(model: torch.nn.Module, placement: ExpertPlacement, rank: int, metadata) -> int:
    """``ValueError`` naming the first MoE layer of ``model`` whose slots on deployment rank ``rank`` are
    not ``placement``'s: its EP rank and size, its physical slots, the logical expert each holds in
    ``metadata`` (SGLang's ``ExpertLocationMetadata``; ``None``: SGLang's loader then writes
    logical expert ``p`` into slot ``p`` only), or its ``w13_weight`` rows; the number of layers checked."""
    layers = moe_modules(model)
    moe_layer = {layer_id: i for i, layer_id in enumerate(moe_layer_ids(model))}
    plan = f"{placement.num_physical} slots over EP{placement.ep_size}, {placement.num_redundant} redundant experts"
    if metadata is not None and metadata.ep_size != placement.ep_size:
        raise ValueError(f"SGLang's ExpertLocationMetadata spreads the experts over ep_size={metadata.ep_size}, the "
                         f"refit plans {plan}")
    want_slots = rank_slots(placement, rank)
    for name, module in layers:
        have = (module.moe_ep_rank, module.moe_ep_size, module.num_experts)
        if have != (rank, placement.ep_size, placement.num_physical):
            raise ValueError(f"{name}: SGLang's FusedMoE is moe_ep_rank={have[0]} of moe_ep_size={have[1]} with "
                             f"num_experts={have[2]} physical slots; the refit plans deployment rank {rank} ({plan}): "
                             "the refit: section and the engine disagree (gen_tp, gen_attention_dp, "
                             "gen_redundant_experts, --ep-size, --ep-num-redundant-experts)")
        start = module.moe_ep_rank * module.num_local_experts
        slots = tuple(range(start, start + module.num_local_experts))
        if slots != want_slots or module.w13_weight.shape[0] != len(slots):
            raise ValueError(f"{name}: SGLang's FusedMoE on deployment rank {rank} holds physical slots "
                             f"{_span(slots)} in {module.w13_weight.shape[0]} w13_weight rows, the refit plans "
                             f"{_span(want_slots)} ({plan})")
        want = [logical for _, logical in slots_of(placement, rank, moe_layer[module.layer_id])]
        if metadata is None:
            held = list(slots)  # SGLang's loader without a map: checkpoint expert p into slot p only
        else:
            held = [int(x) for x in metadata.physical_to_logical_map_cpu[module.layer_id][start:start + len(slots)]]
        if held != want:
            raise ValueError(f"{name}: SGLang's expert location holds logical experts {held[:16]} in deployment "
                             f"rank {rank}'s slots {_span(slots)}, the refit plans {want[:16]} ({plan}): "
                             "--init-expert-location (or EPLB) moved them")
    return len(layers)


def _span(slots: tuple[int, ...]) -> str:
    return f"{slots[0]}..{slots[-1]}" if slots else "none"
