"""``megatron_refit.plan.expert_placement`` against vLLM 0.33's own code: ``determine_expert_map``
and ``ExpertMapManager`` (``fused_moe/expert_map_manager.py``: the slots each EP rank holds, its
``expert_map``, the strategy after ``determine_expert_placement_strategy``'s and the manager's
fallbacks), ``EplbState.build_initial_global_physical_to_logical_map`` and
``RoutedExperts.build_expert_params_mapping`` (which logical expert's checkpoint weights each
physical slot loads), EPLB's ``get_ep_ranks_with_experts_batch`` (the ranks that hold each logical
expert under a rebalanced, per-layer map), and ``ParallelConfig``'s refusal of redundant experts without EPLB."""

from __future__ import annotations

import itertools
import random

import pytest

from megatron_refit.plan.expert_placement import (
    ExpertPlacement,
    expert_map,
    initial_map,
    rank_slots,
    ranks_holding,
    slots_of,
    vllm_placement,
    vllm_strategy,
)

pytest.importorskip("vllm")

NUM_LOGICAL = (8, 16, 60, 64, 256)
EP_SIZES = (1, 2, 3, 4, 8, 16)
NUM_REDUNDANT = (0, 2, 8)
BACKENDS = (None, "allgather_reducescatter", "deepep_high_throughput", "deepep_low_latency", "nixl_ep")
"""None: no all2all kernels (EP over TP alone); otherwise EP over DP=2 with that backend."""


def _parallel_config(ep_size, ep_rank, backend, eplb):
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig

    # as FusedMoEParallelConfig.make builds it: EP over every TP x DP rank, all2all kernels with DP > 1
    dp_size = 1 if backend is None or ep_size == 1 else 2
    return FusedMoEParallelConfig(
        tp_size=1, tp_rank=0, pcp_size=1, pcp_rank=0, dp_size=dp_size, dp_rank=ep_rank * dp_size // ep_size,
        ep_size=ep_size, ep_rank=ep_rank, sp_size=1, use_ep=ep_size > 1,
        all2all_backend=backend or "allgather_reducescatter", enable_eplb=eplb)


def _manager(num_physical, num_redundant, ep_size, ep_rank, *, strategy, num_expert_group, eplb, backend):
    from vllm.model_executor.layers.fused_moe.expert_map_manager import ExpertMapManager

    return ExpertMapManager(
        max_num_batched_tokens=16, top_k=2, global_num_experts=num_physical, num_redundant_experts=num_redundant,
        num_expert_group=num_expert_group, moe_parallel_config=_parallel_config(ep_size, ep_rank, backend, eplb),
        placement_strategy=strategy, enable_eplb=eplb)


@pytest.mark.parametrize("num_logical", NUM_LOGICAL)
@pytest.mark.parametrize("ep_size", EP_SIZES)
def test_each_rank_holds_what_determine_expert_map_gives(num_logical, ep_size):
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    for num_redundant, strategy in itertools.product(NUM_REDUNDANT, ("linear", "round_robin")):
        num_physical = num_logical + num_redundant
        if strategy == "round_robin" and ep_size > num_physical + 1:
            # vLLM's torch.arange(ep_rank, P, ep_size) fails on a rank past P: refused up front here
            with pytest.raises(RuntimeError, match="upper bound and lower bound inconsistent"):
                determine_expert_map(ep_size, num_physical + 1, num_physical, strategy)
            with pytest.raises(ValueError, match=f"ep_size={ep_size} round-robin"):
                ExpertPlacement(num_logical_experts=num_logical, ep_size=ep_size, num_redundant=num_redundant,
                                strategy=strategy)
            continue
        placement = ExpertPlacement(num_logical_experts=num_logical, ep_size=ep_size, num_redundant=num_redundant,
                                    strategy=strategy)
        for rank in range(ep_size):
            local, theirs, _ = determine_expert_map(ep_size, rank, num_physical, strategy)
            slots = rank_slots(placement, rank)
            assert local == len(slots)
            if ep_size == 1:
                assert theirs is None and slots == tuple(range(num_physical))
            else:
                assert tuple(theirs.tolist()) == expert_map(placement, rank), (num_redundant, strategy, rank)


@pytest.mark.parametrize("ep_size", (1, 2, 4, 8))
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_strategy_and_map_are_what_expert_map_manager_runs(ep_size, backend):
    """Every requested strategy, expert grouping, redundancy and EPLB setting: the strategy vLLM's
    manager settles on, and where ``vllm_placement`` accepts the deployment, its expert map."""
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_placement_strategy

    num_logical = 16
    for strategy, group, num_redundant, eplb in itertools.product(
            ("linear", "round_robin"), (None, 1, 2, 8), (0, 2, 8), (False, True)):
        num_physical = num_logical + num_redundant
        ours = vllm_strategy(strategy, ep_size=ep_size, num_expert_group=group, num_redundant=num_redundant,
                             eplb=eplb, all2all_backend=backend if ep_size > 1 else None)
        if ep_size > 1:  # the manager asks it only where EP is on
            assert determine_expert_placement_strategy(
                strategy, _parallel_config(ep_size, 0, backend, eplb), group, num_redundant, eplb) == ours
        try:
            placement = vllm_placement(num_logical_experts=num_logical, ep_size=ep_size, num_redundant=num_redundant,
                                       strategy=strategy, num_expert_group=group, eplb=eplb,
                                       all2all_backend=backend if ep_size > 1 else None)
        except ValueError:
            placement = None  # refused as vLLM refuses it (test_refusals_are_vllms)
        for rank in range(ep_size):
            manager = _manager(num_physical, num_redundant, ep_size, rank, strategy=strategy,
                               num_expert_group=group, eplb=eplb, backend=backend)
            assert manager.placement_strategy == ours, (strategy, group, num_redundant, eplb, rank)
            if placement is None:
                continue
            assert placement.strategy == ours
            assert manager.local_num_experts == len(rank_slots(placement, rank))
            if ep_size > 1:
                assert tuple(manager.expert_map.tolist()) == expert_map(placement, rank)
            assert [manager.map_global_to_local(p) for p in rank_slots(placement, rank)] == \
                list(range(manager.local_num_experts))


@pytest.mark.parametrize("num_logical", NUM_LOGICAL)
def test_the_initial_map_is_eplbs_and_what_the_weight_loader_reads(num_logical):
    from vllm.distributed.eplb.eplb_state import EplbState
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    for num_redundant in (0, 1, 2, 8, 2 * num_logical + 3):
        first = initial_map(num_logical, num_redundant)
        assert list(EplbState.build_initial_global_physical_to_logical_map(num_logical, num_redundant)) == list(first)
        mapping = RoutedExperts.build_expert_params_mapping("gate_proj", "down_proj", "up_proj", num_logical,
                                                            num_redundant, routed_experts_prefix="")
        loads = {physical: int(weight_name.split(".")[1]) for _, weight_name, physical, _ in mapping}
        assert loads == dict(enumerate(first))


@pytest.mark.parametrize("num_logical", (8, 16, 64))
@pytest.mark.parametrize("ep_size", (2, 4, 8))
def test_ranks_holding_a_rebalanced_expert_are_eplbs(num_logical, ep_size):
    import numpy as np
    from vllm.distributed.eplb.rebalance_execute import get_ep_ranks_with_experts_batch
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    rng = random.Random(num_logical * 100 + ep_size)
    for num_redundant in (0, ep_size, 3 * ep_size):
        num_physical = num_logical + num_redundant
        if num_physical % ep_size:
            continue
        rows = []
        for _ in range(3):  # an EPLB rebalance: every expert once, the redundant slots anywhere, shuffled
            row = list(range(num_logical)) + [rng.randrange(num_logical) for _ in range(num_redundant)]
            rng.shuffle(row)
            rows.append(tuple(row))
        placement = vllm_placement(num_logical_experts=num_logical, ep_size=ep_size, num_redundant=num_redundant,
                                   eplb=True, physical_to_logical=tuple(rows))
        num_local = num_physical // ep_size
        for layer, row in enumerate(rows):
            indices = np.array(row)
            holding, _ = get_ep_ranks_with_experts_batch(np.arange(num_logical), num_local, indices, indices)
            for logical in range(num_logical):
                assert ranks_holding(placement, layer, logical) == tuple(sorted(holding[logical]))
            for rank in range(ep_size):  # what each local slot holds: vLLM's expert_map places it
                local = determine_expert_map(ep_size, rank, num_physical)[1].tolist()
                assert slots_of(placement, rank, layer) == tuple(
                    sorted((index, row[p]) for p, index in enumerate(local) if index >= 0))


def test_refusals_are_vllms():
    from vllm.config import ParallelConfig
    from vllm.config.parallel import EPLBConfig

    with pytest.raises(ValueError, match="num_redundant_experts is set to 2 but EPLB is not enabled"):
        ParallelConfig(enable_eplb=False, eplb_config=EPLBConfig(num_redundant_experts=2))
    with pytest.raises(ValueError, match="num_redundant=2"):
        vllm_placement(num_logical_experts=8, ep_size=2, num_redundant=2)
    # FusedMoEFactory's own check (it needs a whole model config to run): EPLB places evenly
    with pytest.raises(ValueError, match="ep_size=4 does not divide the 18 physical experts"):
        vllm_placement(num_logical_experts=16, ep_size=4, num_redundant=2, eplb=True)
