"""vLLM's live EPLB expert map, read where a refit starts (imports no vLLM).

Under ``--enable-eplb`` vLLM's ``EplbState`` (``vllm/distributed/eplb/eplb_state.py``) keeps, per
model, which logical expert each physical slot holds and rewrites it with ``copy_`` at every
rebalance (``_commit_eplb_maps``). ``add_model`` hands each FusedMoE layer of ``model.moe_layers``
(``MixtureOfExperts``: EPLB's layer index is the position there) views of its row through
``set_eplb_state``: ``layer.eplb_state.logical_to_physical_map`` (``[E, max_replicas]``, the slots
of each logical expert, -1 padded) and ``logical_replica_count`` (``[E]``). :func:`live_placement`
reads them back into the plan's :class:`~megatron_refit.plan.expert_placement.ExpertPlacement`
(one ``physical_to_logical`` row per MoE layer) and refuses, by ``ValueError`` naming the layer,
a map it cannot read or that is no placement (a slot held twice or by none, a replica count that
is not its row's). The worker builds its storage for that placement and reads it again at every
refit, before any byte moves (``LiveModelStorage``'s ``live_map``).

Only sync EPLB is read (:func:`check_eplb_config`): async EPLB (vLLM's default) keeps a rebalance
in flight across steps in a background thread that fills its buffers from the weights of the
moment and commits them at later steps, over a refit landed in between; a weight-transfer engine
cannot drain it (``EplbState.drain_async`` is the model runner's). Sync EPLB moves experts and
commits the map inside one step, so between two worker calls nothing is pending.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from megatron_refit.plan.expert_placement import ExpertPlacement, Map
from megatron_refit.plan.gen_layout import GenLayout, deployment_placement


def check_eplb_config(cfg, parallel) -> None:
    """``ValueError`` naming what of vLLM's EPLB (``parallel``: its ``ParallelConfig``) the refit
    cannot follow, or the ``refit:`` section (``cfg``) says otherwise; before any group is joined."""
    eplb = bool(parallel.enable_eplb)
    if eplb and not cfg.gen_eplb:
        raise ValueError("refit.gen_eplb is false, but this vLLM engine runs --enable-eplb: EPLB moves experts "
                         "between slots while serving, and a refit planned at the initial map would write them "
                         "into the wrong slots; set gen_eplb: true (the worker then reads the live map at each refit)")
    if not cfg.gen_eplb:
        return
    if not eplb:
        raise ValueError("refit.gen_eplb is true, but this vLLM engine runs without --enable-eplb: set gen_eplb: "
                         "false (and gen_redundant_experts: 0)")
    redundant = parallel.eplb_config.num_redundant_experts
    if redundant != cfg.gen_redundant_experts:
        raise ValueError(f"refit.gen_redundant_experts={cfg.gen_redundant_experts}, but this vLLM engine runs "
                         f"--eplb-config num_redundant_experts={redundant}")
    if parallel.eplb_config.use_async:
        raise ValueError("refit.gen_eplb: this vLLM engine runs async EPLB (eplb_config.use_async, vLLM's default): "
                         "its rebalance stays in flight across steps in a background thread and commits experts "
                         "copied before a refit over the refit's, which a weight-transfer engine cannot drain; "
                         "run sync EPLB: --eplb-config '{\"use_async\": false}'")
    if cfg.gen_draft:
        raise ValueError("refit.gen_eplb with refit.gen_draft: vLLM balances its draft's experts in an EPLB map of "
                         "their own, which the refit does not read; not planned yet")


def eplb_layout(model, layout: GenLayout, num_experts: int) -> tuple[GenLayout, Callable[[], ExpertPlacement] | None]:
    """Under ``gen_eplb``: ``layout`` holding the map vLLM's EPLB serves now, and the call that
    reads it again (the storage's ``live_map``, at every refit); a dense model: ``layout``, None."""
    if not (layout.expert_parallel and num_experts):
        return layout, None
    # vLLM's initial map where the layout keeps none (EP over TP alone, no redundant experts)
    planned = deployment_placement(layout, num_experts) or ExpertPlacement(
        num_logical_experts=num_experts, ep_size=layout.deployment_size)
    return replace(layout, placement=live_placement(model, planned)), lambda: live_placement(model, planned)


def moe_layers(model) -> list:
    """The model's FusedMoE layers in EPLB's order (``MixtureOfExperts.moe_layers``; a multimodal
    model's language model's)."""
    layers = getattr(model, "moe_layers", None)
    if layers is None and hasattr(model, "get_language_model"):
        layers = getattr(model.get_language_model(), "moe_layers", None)
    if not layers:
        raise ValueError(f"refit.gen_eplb: vLLM's {type(model).__name__} lists no MoE layers (moe_layers) whose "
                         "EPLB map could be read")
    return list(layers)


def read_live_map(model, num_logical: int, num_physical: int) -> tuple[Map, ...]:
    """The physical-to-logical map of every MoE layer of ``model``, from vLLM's EPLB views."""
    return tuple(_layer_map(index, layer, num_logical, num_physical) for index, layer in enumerate(moe_layers(model)))


def live_placement(model, placement: ExpertPlacement) -> ExpertPlacement:
    """``placement`` (the plan's: its experts, ranks, redundant slots and strategy) holding the map
    vLLM's EPLB serves now, one row per MoE layer; ``ValueError`` naming what cannot be read."""
    rows = read_live_map(model, placement.num_logical_experts, placement.num_physical)
    try:
        return ExpertPlacement(num_logical_experts=placement.num_logical_experts, ep_size=placement.ep_size,
                               num_redundant=placement.num_redundant, strategy=placement.strategy,
                               physical_to_logical=rows)
    except ValueError as exc:
        raise ValueError(f"vLLM's live EPLB map is no expert placement of the plan's deployment: {exc}") from exc


def _layer_map(index: int, layer, num_logical: int, num_physical: int) -> Map:
    state = getattr(layer, "eplb_state", None)
    slots = None if state is None else state.logical_to_physical_map
    counts = None if state is None else state.logical_replica_count
    if slots is None or counts is None:
        raise ValueError(f"MoE layer {index}: vLLM holds no EPLB map for it (no eplb_state, or set_eplb_state "
                         "never ran): the engine runs without EPLB, or its model runner did not add the model")
    if slots.dim() != 2 or slots.shape[0] != num_logical or tuple(counts.shape) != (num_logical,):
        raise ValueError(f"MoE layer {index}: vLLM's EPLB logical_to_physical_map is {tuple(slots.shape)} and "
                         f"logical_replica_count {tuple(counts.shape)}, the plan has {num_logical} logical experts")
    counts = counts.detach().to("cpu", torch.int64)
    width = int(counts.max()) if counts.numel() else 0
    if width > slots.shape[1] or int(counts.min()) < 0 or bool((slots[:, width:] != -1).any()):
        raise ValueError(f"MoE layer {index}: vLLM's EPLB logical_replica_count {counts.tolist()[:16]} does not "
                         f"count the slots its logical_to_physical_map lists")
    row = [-1] * num_physical
    for logical, (count, held) in enumerate(zip(counts.tolist(), slots[:, :width].tolist())):
        if any(p < 0 for p in held[:count]) or any(p != -1 for p in held[count:]):
            raise ValueError(f"MoE layer {index}: logical expert {logical} has logical_replica_count {count}, but "
                             f"its logical_to_physical_map row lists slots {held}")
        for physical in held[:count]:
            if physical >= num_physical:
                raise ValueError(f"MoE layer {index}: logical expert {logical} is in physical slot {physical}, "
                                 f"the plan has {num_physical} slots")
            if row[physical] != -1:
                raise ValueError(f"MoE layer {index}: physical slot {physical} holds logical experts "
                                 f"{row[physical]} and {logical} in vLLM's EPLB map")
            row[physical] = logical
    if -1 in row:
        raise ValueError(f"MoE layer {index}: physical slot {row.index(-1)} holds no logical expert in vLLM's "
                         "EPLB map")
    return tuple(row)
