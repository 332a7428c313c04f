"""vLLM's live EPLB map as the worker reads it at each refit, without vLLM (#64): the reader
(:mod:`megatron_refit.engines.vllm.worker.eplb_map`) over stand-in FusedMoE layers that hold what
vLLM's ``EplbState.add_model`` hands each layer (views of one ``[layers, E, 1024]``
``logical_to_physical_map``, -1 padded, and one ``[layers, E]`` ``logical_replica_count``), moved
in place as vLLM's ``_commit_eplb_maps`` does (``copy_``); every refusal by name. The real worker into
vLLM's own EPLB layers: tests/engines/vllm/test_wide_ep_eplb_vllm.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_refit.config import RefitConfig
from megatron_refit.engines.vllm.worker.eplb_map import check_eplb_config, eplb_layout, live_placement
from megatron_refit.plan.expert_placement import ExpertPlacement, initial_map, slots_of
from megatron_refit.plan.gen_layout import GenLayout

E, R, EP, LAYERS = 8, 4, 4, 3
MAX_REPLICAS = 1024
"""vLLM's ``MAX_EXPERT_REDUNDANCY + 1``: the width of ``add_model``'s ``logical_to_physical_map``."""
PLACEMENT = ExpertPlacement(num_logical_experts=E, ep_size=EP, num_redundant=R)
MOVED = (
    (1, 0, 1, 2, 3, 4, 5, 6, 7, 3, 4, 5),  # rank 0 holds logical 1 in two slots
    (7, 6, 5, 4, 3, 2, 1, 0, 0, 1, 2, 3),
    (0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3),  # the initial map
)
"""One map per MoE layer, each a placement of 12 slots over 4 ranks (3 each)."""


def logical_maps(rows) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logical_to_physical_map, logical_replica_count)`` of ``rows`` as vLLM's
    ``compute_logical_maps`` makes them (slots ascending per logical expert), padded to ``MAX_REPLICAS``."""
    slots = torch.full((len(rows), E, MAX_REPLICAS), -1, dtype=torch.int64)
    counts = torch.zeros((len(rows), E), dtype=torch.int64)
    for layer, row in enumerate(rows):
        for physical, logical in enumerate(row):
            slots[layer, logical, counts[layer, logical]] = physical
            counts[layer, logical] += 1
    return slots, counts


class _EplbState:  # vLLM's EplbLayerState: views of one layer's rows
    def __init__(self, slots, counts):
        self.logical_to_physical_map, self.logical_replica_count = slots, counts


class _Model(torch.nn.Module):
    """A MixtureOfExperts stand-in: ``moe_layers`` in EPLB's order, each with its ``eplb_state``
    (as ``add_model`` → ``set_eplb_state`` → ``EplbLayerState.set_layer_state`` leaves them)."""

    def __init__(self, rows):
        super().__init__()
        self.slots, self.counts = logical_maps(rows)  # the EplbState's tensors
        self.moe_layers = [SimpleNamespace(eplb_state=_EplbState(self.slots[i], self.counts[i]))
                           for i in range(len(rows))]

    def commit(self, rows) -> None:
        """A rebalance: the new maps ``copy_``-ed into the same tensors (``_commit_eplb_maps``)."""
        slots, counts = logical_maps(rows)
        self.slots.copy_(slots)
        self.counts.copy_(counts)


def test_the_reader_returns_the_map_vllm_serves_now_not_the_initial_one():
    model = _Model([initial_map(E, R)] * LAYERS)
    assert live_placement(model, PLACEMENT).physical_to_logical == (initial_map(E, R),) * LAYERS
    model.commit(MOVED)  # after vLLM's rebalance: the same views, new contents
    live = live_placement(model, PLACEMENT)
    assert live.physical_to_logical == MOVED
    assert (live.num_logical_experts, live.ep_size, live.num_redundant, live.strategy) == (E, EP, R, "linear")
    # rank 0's three slots in layer 0: logical 1 twice (both written by the refit), logical 0 once
    assert slots_of(live, 0, 0) == ((0, 1), (1, 0), (2, 1))
    assert slots_of(live, 3, 1) == ((0, 1), (1, 2), (2, 3))


def test_eplb_layout_plans_the_live_map_and_reads_it_again_at_each_call():
    model = _Model(MOVED)
    wide = GenLayout(tp=2, attention_dp=2, expert_parallel=True, placement=PLACEMENT)
    layout, live_map = eplb_layout(model, wide, E)
    assert layout.placement.physical_to_logical == MOVED and (layout.tp, layout.attention_dp) == (2, 2)
    model.commit([initial_map(E, R)] * LAYERS)
    assert live_map().physical_to_logical == (initial_map(E, R),) * LAYERS  # read now, not at init
    # EP over TP alone without redundant experts: the plan keeps no placement; EPLB's map is planned
    tp_only = _Model([tuple(range(E))[::-1]] * 2)
    layout, live_map = eplb_layout(tp_only, GenLayout(tp=2, expert_parallel=True), E)
    assert layout.placement == ExpertPlacement(num_logical_experts=E, ep_size=2,
                                               physical_to_logical=(tuple(range(E))[::-1],) * 2)
    dense = GenLayout(tp=2)
    assert eplb_layout(tp_only, dense, 0) == (dense, None)


def _broken(edit) -> _Model:
    model = _Model(MOVED)
    edit(model)
    return model


def _set(tensor, index, value):
    tensor[index] = value


@pytest.mark.parametrize("model, match", [
    (torch.nn.Linear(1, 1), r"vLLM's Linear lists no MoE layers \(moe_layers\)"),
    (_broken(lambda m: setattr(m.moe_layers[1], "eplb_state", None)),
     r"MoE layer 1: vLLM holds no EPLB map for it \(no eplb_state"),
    (_broken(lambda m: setattr(m.moe_layers[2].eplb_state, "logical_to_physical_map", None)),
     r"MoE layer 2: vLLM holds no EPLB map for it"),
    (_broken(lambda m: setattr(m.moe_layers[0].eplb_state, "logical_replica_count", m.counts[0, :7])),
     r"MoE layer 0: vLLM's EPLB logical_to_physical_map is \(8, 1024\) and logical_replica_count \(7,\), the plan "
     r"has 8 logical experts"),
    (_broken(lambda m: _set(m.slots, (1, 0, 5), 4)),  # a slot listed past the expert's replica count
     r"MoE layer 1: vLLM's EPLB logical_replica_count .* does not count the slots its logical_to_physical_map lists"),
    (_broken(lambda m: _set(m.counts, (0, 2), 3)),  # a count past the slots listed
     r"MoE layer 0: logical expert 2 has logical_replica_count 3, but its logical_to_physical_map row lists "
     r"slots \[3, -1, -1\]"),
    (_broken(lambda m: _set(m.slots, (0, 0, 0), 12)),
     r"MoE layer 0: logical expert 0 is in physical slot 12, the plan has 12 slots"),
    (_broken(lambda m: _set(m.slots, (2, 0, 0), 1)),  # slot 1 listed for logical 0 and 1
     r"MoE layer 2: physical slot 1 holds logical experts 0 and 1 in vLLM's EPLB map"),
    (_broken(lambda m: (_set(m.slots, (1, 0, 1), -1), _set(m.counts, (1, 0), 1))),
     r"MoE layer 1: physical slot 8 holds no logical expert in vLLM's EPLB map"),
])
def test_an_unreadable_or_malformed_live_map_is_refused_by_name(model, match):
    with pytest.raises(ValueError, match=match):
        live_placement(model, PLACEMENT)


def test_a_logical_expert_that_no_slot_holds_is_refused_naming_the_plans_check():
    model = _Model(MOVED)
    model.commit([(0,) * 12, *MOVED[1:]])  # not a placement: logical experts 1..7 lost
    with pytest.raises(ValueError, match=r"vLLM's live EPLB map is no expert placement of the plan's deployment: "
                                         r"physical_to_logical\[0\] holds no replica of logical expert 1"):
        live_placement(model, PLACEMENT)


def _parallel(eplb=True, use_async=False, redundant=R):
    return SimpleNamespace(enable_eplb=eplb,
                           eplb_config=SimpleNamespace(use_async=use_async, num_redundant_experts=redundant))


def _cfg(**kw):
    return RefitConfig.from_dict({"enabled": True, "gen_tp": 2, "gen_attention_dp": 2, "gen_expert_parallel": True,
                                  "gen_eplb": True, "gen_redundant_experts": R, **kw})


def test_sync_eplb_as_the_section_names_it_is_read():
    check_eplb_config(_cfg(), _parallel())
    check_eplb_config(_cfg(gen_eplb=False, gen_redundant_experts=0), _parallel(eplb=False, redundant=0))


@pytest.mark.parametrize("cfg, parallel, match", [
    (_cfg(), _parallel(use_async=True),
     r"refit.gen_eplb: this vLLM engine runs async EPLB \(eplb_config.use_async, vLLM's default\): .* run sync "
     r"EPLB: --eplb-config '\{\"use_async\": false\}'"),
    (_cfg(gen_eplb=False, gen_redundant_experts=0), _parallel(redundant=0),
     r"refit.gen_eplb is false, but this vLLM engine runs --enable-eplb: EPLB moves experts"),
    (_cfg(), _parallel(eplb=False), r"refit.gen_eplb is true, but this vLLM engine runs without --enable-eplb"),
    (_cfg(gen_redundant_experts=0), _parallel(),
     r"refit.gen_redundant_experts=0, but this vLLM engine runs --eplb-config num_redundant_experts=4"),
    (_cfg(gen_attention_dp=1, gen_redundant_experts=0, gen_draft=True), _parallel(redundant=0),
     r"refit.gen_eplb with refit.gen_draft: vLLM balances its draft's experts in an EPLB map of their own"),
])
def test_eplb_the_refit_cannot_follow_is_refused_by_name(cfg, parallel, match):
    with pytest.raises(ValueError, match=match):
        check_eplb_config(cfg, parallel)
