"""EPLB moves experts while the engine serves (#64 item 3): an engine rank's storage reads its
engine's live map at the start of each refit (``live_map``, :meth:`FusedLayoutStorage.refresh_experts`)
and, where experts moved, lays its pieces out for the new map over the same tensors; a map that is
not a map of the same slots is refused by name; and the ``refit:`` keys that cannot follow a moving
map (fanout, overlap, LoRA adapter sync) are refused by name with ``gen_eplb``. The group's re-plan
in the handshake is tested end to end in ``tests/megatron/test_wide_ep_refit.py``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_refit.config import RefitConfig
from megatron_refit.engines.fused.layout import FusedLayoutStorage, expected_storage
from megatron_refit.fleet.member import TrainerMember
from megatron_refit.local.fused_engine import Balancer
from megatron_refit.plan.expert_placement import ExpertPlacement, moved
from megatron_refit.plan.gen_layout import GenLayout
from tests.unit.test_wide_ep_layout import D, TP, model, params, permuted_maps

EXPERTS, REDUNDANT = 8, 2


def _placement(seed: int, **kw) -> ExpertPlacement:
    fields = dict(num_logical_experts=EXPERTS, ep_size=TP * D, num_redundant=REDUNDANT,
                  physical_to_logical=permuted_maps(EXPERTS, REDUNDANT, seed, twice_on_rank0=True))
    return ExpertPlacement(**{**fields, **kw})


def _full(table):
    g = torch.Generator().manual_seed(11)
    return {name: torch.randn(shape, generator=g) for name, (shape, _) in table.items()}


def _land(storage, full) -> dict[str, torch.Tensor]:
    for piece in storage.target_specs():
        storage.buffer(piece.name).copy_(full[piece.name][tuple(slice(a, b) for a, b in piece.box)])
    storage.finalize()
    return storage.storage()


@pytest.mark.parametrize("rank", range(TP * D))
def test_a_moved_map_is_laid_out_over_the_same_tensors_and_lands_in_every_slot(rank):
    table, shape = params(EXPERTS), model(EXPERTS)
    first, second = _placement(1), _placement(2)
    layout = GenLayout(tp=TP, attention_dp=D, expert_parallel=True, placement=first)
    balancer = Balancer(first)
    storage = FusedLayoutStorage.allocate(table, layout, shape, gen_index=rank, live_map=balancer)
    full = _full(table)
    assert storage.refresh_experts() is False  # the map it was built for
    _land(storage, full)
    tensors = {name: t.data_ptr() for name, t in storage.tensors().items()}
    balancer.move(storage, second)  # the moved slots' bytes scrambled (NaN)
    assert any(torch.isnan(t).any() for t in storage.tensors().values())
    assert storage.refresh_experts() is True and storage.experts_moved == 1
    assert storage.refresh_experts() is False  # read again: nothing moved since
    assert {name: t.data_ptr() for name, t in storage.tensors().items()} == tensors  # the engine's own memory
    fresh = FusedLayoutStorage.allocate(table, dataclasses.replace(layout, placement=second), shape, gen_index=rank)
    assert storage.target_specs() == fresh.target_specs()
    got = _land(storage, full)
    want = expected_storage(full, fresh.target_specs(), shape, TP, fresh.slots)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("change, named", [
    (dict(num_redundant=REDUNDANT + 4, physical_to_logical=()), "num_redundant=6"),
    (dict(ep_size=TP, physical_to_logical=()), "ep_size=2"),
    (dict(strategy="round_robin", physical_to_logical=()), "strategy=.round_robin."),
])
def test_a_map_of_other_slots_is_refused_by_name(change, named):
    with pytest.raises(ValueError, match=named):
        moved(_placement(3, **change), _placement(1), 2)


def test_a_map_that_is_not_a_placement_or_has_other_layers_is_refused():
    with pytest.raises(ValueError, match="must be an ExpertPlacement, got dict"):
        moved({"layer": 0}, _placement(1), 2)
    rows = tuple(_placement(1).physical_to_logical) * 2  # 4 maps, the model 2 MoE layers
    with pytest.raises(ValueError, match="holds 4 layer maps, the model 2 MoE layers"):
        moved(_placement(1, physical_to_logical=rows), _placement(1), 2)
    # one map standing for every layer is the same map as it spelled per layer
    one = ExpertPlacement(num_logical_experts=EXPERTS, ep_size=TP * D, num_redundant=REDUNDANT)
    per_layer = dataclasses.replace(one, physical_to_logical=one.physical_to_logical * 2)
    assert moved(per_layer, one, 2) is False and moved(_placement(1), one, 2) is True


def test_storage_refresh_propagates_a_reader_error_and_needs_a_placement():
    table, shape = params(EXPERTS), model(EXPERTS)
    layout = GenLayout(tp=TP, attention_dp=D, expert_parallel=True, placement=_placement(1))

    def unreadable():
        raise ValueError("the engine cannot report its expert map")

    storage = FusedLayoutStorage.allocate(table, layout, shape, gen_index=0, live_map=unreadable)
    with pytest.raises(ValueError, match="cannot report its expert map"):
        storage.refresh_experts()
    with pytest.raises(ValueError, match="needs the rank's RankLayout"):
        FusedLayoutStorage.allocate(table, GenLayout(tp=TP, expert_parallel=True), shape, gen_index=0,
                                    live_map=unreadable)


EPLB = {"enabled": True, "engine": "vllm", "gen_tp": 2, "gen_attention_dp": 2, "gen_expert_parallel": True,
        "gen_eplb": True, "gen_redundant_experts": 2}


@pytest.mark.parametrize("key, value", [("fanout", "chain"), ("fanout", "auto"), ("overlap", "on")])
def test_keys_that_cannot_follow_a_moving_map_are_refused_by_name(key, value):
    with pytest.raises(ValueError, match=f"refit.{key}='{value}' with refit.gen_eplb"):
        RefitConfig.from_dict({**EPLB, key: value})
    RefitConfig.from_dict({**EPLB, key: "off"})


def test_adapter_sync_is_refused_with_eplb_before_the_group_is_used():
    cfg = RefitConfig.from_dict({**EPLB, "lora_sync": "adapters"})
    with pytest.raises(ValueError, match="refit.lora_sync='adapters' with refit.gen_eplb"):
        TrainerMember(None, [], [object()], cfg, num_train=1)
