"""megatron_refit.plan.expert_placement: properties over a grid of expert counts, EP sizes,
redundant experts, both strategies and permuted per-layer maps; the refusals name the bad value.
(Against vLLM's and SGLang's own code: tests/engines/{vllm,sglang}/test_wide_ep_*.py.)"""

from __future__ import annotations

import random

import pytest

from megatron_refit.plan.expert_placement import (
    ExpertPlacement,
    expert_map,
    initial_map,
    rank_of,
    rank_slots,
    ranks_holding,
    sglang_placement,
    slots_of,
    vllm_placement,
    vllm_strategy,
)

GRID = [(e, ep, r, strategy) for e in (8, 16, 64, 256) for ep in (1, 2, 4, 8, 16) for r in (0, 2, 8)
        for strategy in ("linear", "round_robin")]
NUM_LAYERS = 3


def permuted_maps(num_logical, num_redundant, seed):
    """Per layer: every logical expert once, the redundant slots on random experts, shuffled."""
    rng = random.Random(seed)
    rows = []
    for _ in range(NUM_LAYERS):
        row = list(range(num_logical)) + [rng.randrange(num_logical) for _ in range(num_redundant)]
        rng.shuffle(row)
        rows.append(tuple(row))
    return tuple(rows)


@pytest.mark.parametrize("num_logical,ep,num_redundant,strategy", GRID)
def test_every_slot_on_one_rank_and_every_expert_held(num_logical, ep, num_redundant, strategy):
    maps = permuted_maps(num_logical, num_redundant, seed=num_logical * 1000 + ep * 10 + num_redundant)
    if strategy == "round_robin" and ep > num_logical + num_redundant + 1:
        with pytest.raises(ValueError, match=f"ep_size={ep} round-robin over {num_logical + num_redundant} physical"):
            ExpertPlacement(num_logical_experts=num_logical, ep_size=ep, num_redundant=num_redundant,
                            strategy=strategy)
        return
    placement = ExpertPlacement(num_logical_experts=num_logical, ep_size=ep, num_redundant=num_redundant,
                                strategy=strategy, physical_to_logical=maps)
    num_physical = num_logical + num_redundant
    held = [rank_slots(placement, rank) for rank in range(ep)]
    assert sorted(p for slots in held for p in slots) == list(range(num_physical))
    assert max(map(len, held)) - min(map(len, held)) <= 1
    for rank, slots in enumerate(held):
        assert [rank_of(placement, p) for p in slots] == [rank] * len(slots)
        local = expert_map(placement, rank)
        assert [local[p] for p in slots] == list(range(len(slots)))
        assert sum(index >= 0 for index in local) == len(slots)
    for layer in range(NUM_LAYERS):
        row = maps[layer]
        on_rank = [slots_of(placement, rank, layer) for rank in range(ep)]
        for rank, pairs in enumerate(on_rank):
            assert pairs == tuple((i, row[p]) for i, p in enumerate(held[rank]))
        for logical in range(num_logical):
            ranks = ranks_holding(placement, layer, logical)
            assert ranks, logical
            assert ranks == tuple(r for r in range(ep) if any(e == logical for _, e in on_rank[r]))
            # every replica is listed: two on one rank included
            listed = sum(e == logical for pairs in on_rank for _, e in pairs)
            assert listed == row.count(logical)


def test_two_replicas_on_one_rank_are_both_listed():
    # 4 experts + 2 redundant over 2 ranks: rank 0 holds slots 0-2, rank 1 slots 3-5
    placement = ExpertPlacement(num_logical_experts=4, ep_size=2, num_redundant=2,
                                physical_to_logical=((0, 1, 0, 2, 3, 3), (1, 1, 1, 0, 2, 3)))
    assert slots_of(placement, 0, 0) == ((0, 0), (1, 1), (2, 0))
    assert slots_of(placement, 1, 0) == ((0, 2), (1, 3), (2, 3))
    assert slots_of(placement, 0, 1) == ((0, 1), (1, 1), (2, 1))
    assert ranks_holding(placement, 0, 0) == (0,) and ranks_holding(placement, 1, 1) == (0,)
    assert ranks_holding(placement, 1, 3) == (1,)


def test_one_map_serves_every_layer_and_the_default_is_the_initial_map():
    placement = ExpertPlacement(num_logical_experts=8, ep_size=4, num_redundant=2)
    assert placement.physical_to_logical == ((0, 1, 2, 3, 4, 5, 6, 7, 0, 1),) == (initial_map(8, 2),)
    assert placement.layer_map(0) is placement.layer_map(47)
    assert ExpertPlacement(num_logical_experts=4, ep_size=2, physical_to_logical=[[3, 2, 1, 0]]).layer_map(5) == \
        (3, 2, 1, 0)


def test_vllm_uneven_split_gives_the_first_ranks_one_more():
    placement = vllm_placement(num_logical_experts=10, ep_size=4)
    assert [rank_slots(placement, r) for r in range(4)] == [(0, 1, 2), (3, 4, 5), (6, 7), (8, 9)]
    rr = vllm_placement(num_logical_experts=10, ep_size=4, strategy="round_robin", num_expert_group=2)
    assert rr.strategy == "round_robin"
    assert [rank_slots(rr, r) for r in range(4)] == [(0, 4, 8), (1, 5, 9), (2, 6), (3, 7)]
    assert expert_map(rr, 1) == (-1, 0, -1, -1, -1, 1, -1, -1, -1, 2)
    # more ranks than slots: the last ranks hold none
    assert rank_slots(vllm_placement(num_logical_experts=8, ep_size=16), 12) == ()


@pytest.mark.parametrize("kwargs,expected", [
    ({}, "round_robin"),
    ({"num_expert_group": None}, "linear"),
    ({"num_expert_group": 1}, "linear"),
    ({"num_redundant": 2}, "linear"),
    ({"eplb": True}, "linear"),
    ({"ep_size": 1}, "linear"),
    ({"all2all_backend": "allgather_reducescatter"}, "linear"),
    ({"all2all_backend": "deepep_high_throughput"}, "linear"),
    ({"all2all_backend": "deepep_low_latency"}, "round_robin"),
    ({"all2all_backend": "nixl_ep"}, "round_robin"),
])
def test_vllm_falls_back_from_round_robin(kwargs, expected):
    args = {"ep_size": 4, "num_expert_group": 8, "num_redundant": 0, "eplb": False} | kwargs
    assert vllm_strategy("round_robin", **args) == expected
    assert vllm_strategy("linear", **args) == "linear"


@pytest.mark.parametrize("make,match", [
    (lambda: ExpertPlacement(num_logical_experts=0, ep_size=2), "num_logical_experts must be an int >= 1, got 0"),
    (lambda: ExpertPlacement(num_logical_experts=8, ep_size=0), "ep_size must be an int >= 1, got 0"),
    (lambda: ExpertPlacement(num_logical_experts=8, ep_size=2, num_redundant=-1), "num_redundant .* got -1"),
    (lambda: ExpertPlacement(num_logical_experts=8, ep_size=2, strategy="striped"), "'striped'"),
    (lambda: ExpertPlacement(num_logical_experts=4, ep_size=2, physical_to_logical=((0, 1, 2),)),
     r"physical_to_logical\[0\] has 3 slots, .* = 4"),
    (lambda: ExpertPlacement(num_logical_experts=4, ep_size=2, physical_to_logical=((0, 1, 2, 3), (0, 1, 2, 4))),
     r"physical_to_logical\[1\]\[3\] = 4 is not a logical expert of 4"),
    (lambda: ExpertPlacement(num_logical_experts=4, ep_size=2, num_redundant=1,
                             physical_to_logical=((0, 1, 2, 0, 1),)),
     r"physical_to_logical\[0\] holds no replica of logical expert 3"),
    (lambda: ExpertPlacement(num_logical_experts=4, ep_size=2, physical_to_logical=(0, 1, 2, 3)),
     r"one map per MoE layer, got 0 at \[0\]"),
    (lambda: vllm_placement(num_logical_experts=8, ep_size=2, num_redundant=2), "num_redundant=2"),
    (lambda: vllm_placement(num_logical_experts=8, ep_size=4, num_redundant=2, eplb=True),
     "ep_size=4 does not divide the 10 physical experts"),
    (lambda: vllm_placement(num_logical_experts=8, ep_size=1, eplb=True), "ep_size=1"),
    (lambda: vllm_placement(num_logical_experts=4, ep_size=2, physical_to_logical=((1, 0, 2, 3),)),
     "only EPLB moves experts"),
    (lambda: vllm_strategy("striped", ep_size=2, num_expert_group=2, num_redundant=0, eplb=False), "'striped'"),
    (lambda: sglang_placement(num_logical_experts=8, ep_size=3), "ep_size=3 does not divide the 8 physical"),
    (lambda: sglang_placement(num_logical_experts=8, ep_size=4, num_redundant=2), "ep_size=4 .* 10 physical"),
])
def test_refusals_name_the_bad_value(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_queries_refuse_what_is_out_of_range():
    placement = ExpertPlacement(num_logical_experts=8, ep_size=2, physical_to_logical=(initial_map(8, 0),) * 2)
    with pytest.raises(ValueError, match="ep_rank 2 is not one of the 2 EP ranks"):
        rank_slots(placement, 2)
    with pytest.raises(ValueError, match="layer 2 is not one of the 2 MoE layers"):
        slots_of(placement, 0, 2)
    with pytest.raises(ValueError, match="logical expert 8 is not one of 8"):
        ranks_holding(placement, 0, 8)
    with pytest.raises(ValueError, match="physical expert -1 is not one of 8"):
        rank_of(placement, -1)


def test_sglang_places_contiguous_blocks():
    placement = sglang_placement(num_logical_experts=16, ep_size=4, num_redundant=4)
    assert placement.strategy == "linear"
    assert [rank_of(placement, p) for p in range(20)] == [p // 5 for p in range(20)]
