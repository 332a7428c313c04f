"""A wide expert-parallel deployment rank's vLLM-shaped storage (#64): the FusedMoE weights have
one row per physical slot of the rank (redundant experts included), each received expert lands in
every slot its MoE layer's map gives it (two on one rank included) after ``finalize``, the dense
weights as at TP rank ``i % tp``; checked against the placement read directly (slot -> physical ->
logical), not through the layout under test."""

from __future__ import annotations

import pytest
import torch

from megatron_refit.engines.fused.layout import FusedLayoutStorage, expected_storage
from megatron_refit.plan.expert_placement import ExpertPlacement, rank_slots
from megatron_refit.plan.gen_layout import GenLayout, gen_target_specs
from tests.unit.test_wide_ep_layout import D, MOE_LAYERS, TP, model, params, permuted_maps


def _full(table):
    g = torch.Generator().manual_seed(7)
    return {name: torch.randn(shape, generator=g) for name, (shape, _) in table.items()}


def _landed(table, layout, shape, full):
    """Every deployment rank's storage after each of its pieces was written into its buffer and
    the refit finalized (what a receiver does)."""
    out = []
    for rank in range(layout.deployment_size):
        storage = FusedLayoutStorage.allocate(table, layout, shape, gen_index=rank)
        for piece in storage.target_specs():
            storage.buffer(piece.name).copy_(full[piece.name][tuple(slice(a, b) for a, b in piece.box)])
        storage.finalize()
        out.append(storage)
    return out


@pytest.mark.parametrize("experts,redundant,strategy", [(8, 2, "linear"), (64, 4, "linear"), (8, 0, "round_robin")])
def test_every_slot_holds_its_logical_expert(experts, redundant, strategy):
    maps = permuted_maps(experts, redundant, seed=3, twice_on_rank0=strategy == "linear" and redundant > 0)
    placement = ExpertPlacement(num_logical_experts=experts, ep_size=TP * D, num_redundant=redundant,
                                strategy=strategy, physical_to_logical=maps)
    layout = GenLayout(tp=TP, attention_dp=D, expert_parallel=True, placement=placement)
    table, shape = params(experts), model(experts)
    full = _full(table)
    twice = 0
    for rank, storage in enumerate(_landed(table, layout, shape, full)):
        got = storage.storage()
        slots = rank_slots(placement, rank)
        for moe, layer in enumerate(MOE_LAYERS):
            prefix = f"model.layers.{layer}.mlp.experts."
            w13, w2 = got[prefix + "w13_weight"], got[prefix + "w2_weight"]
            assert w13.shape[0] == w2.shape[0] == len(slots)
            held = [maps[moe][physical] for physical in slots]
            twice += len(held) - len(set(held))
            for local, logical in enumerate(held):
                e = f"model.layers.{layer}.mlp.experts.{logical}."
                assert torch.equal(w13[local], torch.cat([full[e + "gate_proj.weight"], full[e + "up_proj.weight"]]))
                assert torch.equal(w2[local], full[e + "down_proj.weight"])
        # the dense weights are TP rank rank % TP's, as at TP2 without data-parallel ranks
        dense = FusedLayoutStorage.allocate(table, GenLayout(tp=TP, expert_parallel=True), shape,
                                            gen_index=rank % TP)
        for piece in dense.target_specs():
            if ".experts." not in piece.name:
                dense.buffer(piece.name).copy_(full[piece.name][tuple(slice(a, b) for a, b in piece.box)])
        for name, tensor in dense.storage().items():
            if ".experts." not in name:
                assert torch.equal(got[name], tensor), name
        assert all(torch.equal(got[n], t) for n, t in expected_storage(full, storage.target_specs(), shape, TP,
                                                                     storage.slots).items())
    if strategy == "linear" and redundant:
        assert twice > 0  # an expert in two slots of one rank was written into both


def test_each_expert_received_once_per_rank():
    """A rank that holds an expert in two slots receives its bytes once (one piece, one buffer)."""
    maps = permuted_maps(8, 2, seed=5, twice_on_rank0=True)
    placement = ExpertPlacement(num_logical_experts=8, ep_size=TP * D, num_redundant=2, physical_to_logical=maps)
    layout = GenLayout(tp=TP, attention_dp=D, expert_parallel=True, placement=placement)
    table = params(8)
    pieces = gen_target_specs(table, layout, model(8))[0]
    names = [p.name for p in pieces]
    assert len(names) == len(set(names))
    storage = FusedLayoutStorage.allocate(table, layout, model(8), gen_index=0)
    assert storage.slots.count == len(rank_slots(placement, 0))
    first = maps[0][rank_slots(placement, 0)[0]]
    assert storage.slots.of(f"model.layers.{MOE_LAYERS[0]}.mlp.experts.{first}.down_proj.weight") == (0, 1)


def test_expert_not_held_is_named():
    placement = ExpertPlacement(num_logical_experts=8, ep_size=TP * D)
    storage = FusedLayoutStorage.allocate(params(8), GenLayout(tp=TP, attention_dp=D, expert_parallel=True,
                                                               placement=placement), model(8), gen_index=0)
    with pytest.raises(ValueError, match=r"experts\.7\.down_proj\.weight: deployment rank 0 holds no slot"):
        storage.slots.of(f"model.layers.{MOE_LAYERS[0]}.mlp.experts.7.down_proj.weight")
