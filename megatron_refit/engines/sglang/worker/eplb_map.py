"""SGLang's live expert map, read where a refit starts (imports no SGLang).

SGLang 0.5.23 keeps one ``ExpertLocationMetadata`` per worker (``get_global_expert_location_metadata()``):
``physical_to_logical_map_cpu``, ``[decoder layers, E + R]``, says which logical expert each physical
slot holds. Its FusedMoE slots are contiguous blocks (``moe_ep_rank * num_local_experts`` on), so
the map is the whole placement. :func:`live_placement` reads it back into the plan's
:class:`~megatron_refit.plan.expert_placement.ExpertPlacement`, one row per MoE layer in layer order
(the rows of the decoder layers whose FusedMoE holds routed experts), and refuses, by ``ValueError``
naming what is wrong, a map it cannot read or that is no placement of the plan's slots. The loader
builds its storage for that placement and reads it again at every refit, before any byte moves
(``LiveModelStorage``'s ``live_map``).

**When EPLB moves experts** (``--enable-eplb``, ``srt/eplb/``): ``EPLBManager.on_forward_pass_end``
rebalances every ``eplb_rebalance_num_iterations`` forward passes, on the scheduler thread:
``ExpertLocationUpdater.update`` first moves the weights of a chunk of layers between slots (P2P and
in-place copies into ``w13_weight`` / ``w2_weight``), then writes the new map into the global
metadata in place (``ExpertLocationMetadata.update``), in one call. The loader runs on the same
thread, between forward passes (under SGLang's pause), so it never sees a layer whose weights moved
and whose map did not. With ``--eplb-rebalance-layers-per-chunk`` one rebalance spans forward passes
(``rebalance`` yields between chunks): a refit between two chunks reads, layer by layer, the map its
weights are in (the moved chunks' new one, the others' old one) and lands into it, and the later
chunks move the refit's bytes as they would have moved the old ones
(``tests/engines/sglang/test_wide_ep_eplb_sglang.py`` lands a refit between two chunks). What the
refit cannot follow is refused by :func:`check_eplb_config`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from megatron_refit.engines.sglang.worker.expert_location import moe_layer_ids
from megatron_refit.plan.expert_placement import ExpertPlacement, sglang_placement
from megatron_refit.plan.gen_layout import GenLayout, deployment_placement


def check_eplb_config(cfg, moe) -> None:
    """``ValueError`` naming what of SGLang's expert placement flags (``moe``: its ``get_exec().moe``)
    the ``refit:`` section (``cfg``) says otherwise, or the refit cannot follow; before any group is
    joined."""
    if moe.enable_eplb and not cfg.gen_eplb:
        raise ValueError("refit.gen_eplb is false, but this SGLang engine runs --enable-eplb: EPLB moves experts "
                         "between slots while serving, and a refit planned at the connect-time map would write them "
                         "into the wrong slots; set gen_eplb: true (the loader then reads the live map at each refit)")
    if cfg.gen_eplb and not moe.enable_eplb:
        raise ValueError("refit.gen_eplb is true, but this SGLang engine runs without --enable-eplb: set "
                         "gen_eplb: false")
    if moe.ep_num_redundant_experts != cfg.gen_redundant_experts:
        raise ValueError(f"refit.gen_redundant_experts={cfg.gen_redundant_experts}, but this SGLang engine runs "
                         f"--ep-num-redundant-experts {moe.ep_num_redundant_experts}")
    if cfg.gen_draft and (cfg.gen_eplb or cfg.gen_redundant_experts):
        key = "gen_eplb" if cfg.gen_eplb else "gen_redundant_experts"
        raise ValueError(f"refit.gen_draft with refit.{key}: SGLang's draft MoE layers lie past the target's expert "
                         "map (its loader then writes logical expert e into slot e only), which the refit does not "
                         "plan yet")
    if cfg.gen_eplb and moe.elastic_ep_backend:
        raise ValueError(f"refit.gen_eplb: this SGLang engine runs elastic EP (--elastic-ep-backend "
                         f"{moe.elastic_ep_backend}): its rebalance after a lost rank reloads the experts that rank "
                         "held from disk or its backup (update_weights_from_disk), not the refit's version, and a "
                         "scale-up changes the EP size; not planned")


def live_placement(model: torch.nn.Module, metadata, planned: ExpertPlacement) -> ExpertPlacement:
    """The placement SGLang serves now: ``planned`` (the plan's experts, EP size and redundant slots)
    holding the rows of ``metadata`` (SGLang's ``ExpertLocationMetadata`` in force) at ``model``'s MoE
    layers; ``ValueError`` naming what cannot be read or is no placement of ``planned``'s slots."""
    if metadata is None:
        raise ValueError("SGLang holds no ExpertLocationMetadata (get_global_expert_location_metadata() is None): "
                         "the engine cannot report its expert map, which refit.gen_eplb and "
                         "gen_redundant_experts are planned from")
    plan = f"{planned.num_physical} slots over EP{planned.ep_size}, {planned.num_redundant} redundant experts"
    if metadata.ep_size != planned.ep_size:
        raise ValueError(f"SGLang's ExpertLocationMetadata spreads the experts over ep_size={metadata.ep_size}, the "
                         f"refit plans {plan}")
    table = getattr(metadata, "physical_to_logical_map_cpu", None)
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.is_floating_point():
        shape = tuple(table.shape) if isinstance(table, torch.Tensor) else type(table).__name__
        raise ValueError(f"SGLang's ExpertLocationMetadata.physical_to_logical_map_cpu is {shape}: not an integer "
                         "[layers, physical slots] map")
    if table.shape[1] != planned.num_physical:
        raise ValueError(f"SGLang's expert map holds {table.shape[1]} physical slots per layer, the refit plans "
                         f"{planned.num_logical_experts} experts + {planned.num_redundant} redundant "
                         "(refit.gen_redundant_experts, --ep-num-redundant-experts)")
    layer_ids = moe_layer_ids(model)
    if layer_ids[-1] >= table.shape[0]:
        raise ValueError(f"SGLang's expert map has {table.shape[0]} layer rows, the model's FusedMoE layers are "
                         f"decoder layers {layer_ids[0]}..{layer_ids[-1]}")
    rows = tuple(map(tuple, table[layer_ids].tolist()))
    try:
        return sglang_placement(num_logical_experts=planned.num_logical_experts, ep_size=planned.ep_size,
                                num_redundant=planned.num_redundant, physical_to_logical=rows)
    except ValueError as exc:
        raise ValueError(f"SGLang's expert map is no placement of the plan's slots (MoE layer i: decoder layer "
                         f"{layer_ids}[i]): {exc}") from exc


def live_layout(model: torch.nn.Module, layout: GenLayout, num_experts: int,
                metadata: Callable[[], object]) -> tuple[GenLayout, Callable[[], ExpertPlacement]]:
    """``layout`` holding the placement SGLang serves now, and the reader that reads it again (the
    storage's ``live_map``, at every refit). ``metadata``: SGLang's ``get_global_expert_location_metadata``,
    called at each read (a rebalance updates the metadata in place; SGLang may also replace it)."""
    planned = deployment_placement(layout, num_experts) or ExpertPlacement(num_logical_experts=num_experts,
                                                                           ep_size=layout.deployment_size)

    def live_map() -> ExpertPlacement:
        return live_placement(model, metadata(), planned)

    return dataclasses.replace(layout, placement=live_map()), live_map
