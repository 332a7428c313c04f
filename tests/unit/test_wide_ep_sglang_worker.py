"""The SGLang worker's side of a wide expert-parallel deployment, without SGLang (#64): its engine rank
from SGLang's parallel state (``--tp N --enable-dp-attention --dp D --ep-size N`` is one deployment of N
ranks, rank = SGLang's ``tp_rank``), and its live FusedMoE slots and expert location held to the plan's,
refused by name where they differ. The real loader into SGLang's own FusedMoE:
tests/engines/sglang/test_wide_ep_sglang_refit.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_refit.config import RefitConfig
from megatron_refit.engines.sglang.worker.expert_location import check_expert_location
from megatron_refit.engines.sglang.worker.rank import engine_rank
from megatron_refit.plan.expert_placement import ExpertPlacement, initial_map, sglang_placement


def _parallel(tp=4, attn_dp=2, tp_rank=0, ep=None, dp_lm_head=True, **kw):
    """SGLang's ``get_parallel()`` as ``runtime_context.derive_spawn_ranks`` / ``derive_attention_ranks`` fill it."""
    attn_tp = tp // attn_dp
    ep = tp if ep is None else ep
    fields = dict(tp_size=tp, tp_rank=tp_rank, attn_dp_size=attn_dp, attn_tp_size=attn_tp, attn_cp_size=1,
                  attn_dp_rank=tp_rank // attn_tp, attn_tp_rank=tp_rank % attn_tp, moe_ep_size=ep,
                  moe_ep_rank=tp_rank // (tp // ep), enable_dp_lm_head=dp_lm_head)
    return SimpleNamespace(**{**fields, **kw})


def _cfg(**kw):
    return RefitConfig.from_dict({"enabled": True, "engine": "sglang", "gen_tp": 2, "gen_expert_parallel": True,
                                  "gen_attention_dp": 2, **kw})


def test_a_dp_attention_deployments_rank_is_sglangs_tp_rank():
    cfg = _cfg(gen_dp=2)
    ranks = [engine_rank(cfg, _parallel(tp_rank=t), replica=r, moe=True) for r in (0, 1) for t in range(4)]
    assert ranks == list(range(8))
    # dp_rank * gen_tp + tp_rank: SGLang's attention ranks laid out as the plan's
    assert [(p.attn_dp_rank, p.attn_tp_rank) for p in map(lambda t: _parallel(tp_rank=t), range(4))] == \
        [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_an_engine_without_dp_attention_keeps_its_tp_rank():
    cfg = RefitConfig.from_dict({"enabled": True, "engine": "sglang", "gen_tp": 2, "gen_dp": 2})
    assert [engine_rank(cfg, _parallel(tp=2, attn_dp=1, ep=1, tp_rank=t), replica=1, moe=False)
            for t in (0, 1)] == [2, 3]


@pytest.mark.parametrize("cfg, parallel, moe, match", [
    (dict(gen_attention_dp=1), _parallel(tp=4, attn_dp=1), True, r"refit.gen_tp=2, but this SGLang engine runs "
                                                                  r"tp_size=4"),
    (dict(gen_attention_dp=1, gen_tp=4), _parallel(), True,
     r"refit.gen_attention_dp=1, but this SGLang engine runs DP attention at attn_dp_size=2 .* attn_tp_size=2"),
    ({}, _parallel(), False, r"gen_attention_dp=2 with gen_expert_parallel=True for a dense model"),
    (dict(gen_expert_parallel=False), _parallel(ep=1), True, r"with gen_expert_parallel=False for a MoE model"),
    (dict(gen_tp=4), _parallel(tp=4), True, r"the refit plans SGLang's tp_size=8 \(--tp: gen_tp \* gen_attention_dp\), "
                                            r"this SGLang engine runs tp_size=4"),
    (dict(gen_attention_dp=4, gen_tp=1), _parallel(), True, r"plans SGLang's attn_dp_size=4 .* runs attn_dp_size=2"),
    ({}, _parallel(attn_cp_size=2), True, r"plans SGLang's attn_cp_size=1 .* runs attn_cp_size=2"),
    ({}, _parallel(ep=2), True, r"plans SGLang's moe_ep_size=4 \(--ep-size: tp_size\), this SGLang engine runs "
                                r"moe_ep_size=2"),
    ({}, _parallel(dp_lm_head=False), True, r"shards lm_head over all tp_size=4 ranks.*--enable-dp-lm-head"),
    ({}, _parallel(tp_rank=2, moe_ep_rank=1), True, r"tp_rank=2, moe_ep_rank=1, at attn_dp_rank=1, attn_tp_rank=0: "
                                                     r"the refit plans deployment rank 2"),
])
def test_a_deployment_the_engine_does_not_run_is_named(cfg, parallel, moe, match):
    with pytest.raises(ValueError, match=match):
        engine_rank(_cfg(**cfg), parallel, replica=0, moe=moe)


class _FusedMoE(torch.nn.Module):
    """SGLang's ``FusedMoE`` as the check reads it."""

    def __init__(self, layer_id, ep_rank, ep_size=4, num_experts=8, rows=None):
        super().__init__()
        self.layer_id, self.moe_ep_rank, self.moe_ep_size, self.num_experts = layer_id, ep_rank, ep_size, num_experts
        self.num_local_experts = num_experts // ep_size
        self.w13_weight = torch.nn.Parameter(torch.zeros(self.num_local_experts if rows is None else rows, 4, 2))


def _model(*layers):
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(layers)
    return model


def _metadata(rows, ep_size=4):
    """SGLang's ``ExpertLocationMetadata`` as the check reads it."""
    return SimpleNamespace(ep_size=ep_size, physical_to_logical_map_cpu=torch.tensor(rows))


def test_sglangs_slots_and_expert_location_are_held_to_the_plans():
    placement = sglang_placement(num_logical_experts=8, ep_size=4)
    trivial = _metadata([list(initial_map(8, 0))] * 2)
    assert check_expert_location(_model(_FusedMoE(0, 2), _FusedMoE(1, 2)), placement, 2, trivial) == 2
    assert check_expert_location(_model(_FusedMoE(0, 3)), placement, 3, None) == 1  # no map: slot p holds p
    with pytest.raises(ValueError, match=r"layers\.0: SGLang's FusedMoE is moe_ep_rank=1 of moe_ep_size=4 with "
                                         r"num_experts=8 physical slots; the refit plans deployment rank 2 \(8 slots "
                                         r"over EP4, 0 redundant experts\)"):
        check_expert_location(_model(_FusedMoE(0, 1)), placement, 2, trivial)
    with pytest.raises(ValueError, match=r"moe_ep_size=2 with num_experts=8"):
        check_expert_location(_model(_FusedMoE(0, 2, ep_size=2)), placement, 2, None)
    with pytest.raises(ValueError, match=r"layers\.0: SGLang's FusedMoE on deployment rank 2 holds physical slots "
                                         r"4\.\.5 in 3 w13_weight rows, the refit plans 4\.\.5"):
        check_expert_location(_model(_FusedMoE(0, 2, rows=3)), placement, 2, trivial)
    with pytest.raises(ValueError, match=r"ExpertLocationMetadata spreads the experts over ep_size=2"):
        check_expert_location(_model(_FusedMoE(0, 2)), placement, 2, _metadata([list(range(8))], ep_size=2))


def test_a_moved_expert_location_is_refused_by_layer():
    placement = sglang_placement(num_logical_experts=8, ep_size=4)
    moved = _metadata([list(range(8)), [0, 1, 2, 3, 5, 4, 6, 7]])  # layer 1: experts 4 and 5 swapped on rank 2
    assert check_expert_location(_model(_FusedMoE(0, 1), _FusedMoE(1, 1)), placement, 1, moved) == 2
    with pytest.raises(ValueError, match=r"layers\.1: SGLang's expert location holds logical experts \[5, 4\] in "
                                         r"deployment rank 2's slots 4\.\.5, the refit plans \[4, 5\]"):
        check_expert_location(_model(_FusedMoE(0, 2), _FusedMoE(1, 2)), placement, 2, moved)
    # the plan's own moved map (per decoder layer, as SGLang indexes it) is accepted
    planned = ExpertPlacement(num_logical_experts=8, ep_size=4,
                              physical_to_logical=(tuple(range(8)), (0, 1, 2, 3, 5, 4, 6, 7)))
    assert check_expert_location(_model(_FusedMoE(0, 2), _FusedMoE(1, 2)), planned, 2, moved) == 2


def test_a_model_without_fused_moe_is_named():
    with pytest.raises(ValueError, match=r"the SGLang model has no FusedMoE layer"):
        check_expert_location(_model(torch.nn.Linear(2, 2)), sglang_placement(num_logical_experts=8, ep_size=4), 0,
                              None)


def test_the_loader_receives_moving_and_redundant_experts_and_refuses_a_tp_rank_before_touching_the_engine():
    """SGLang declares ``gen_attention_dp``, ``gen_redundant_experts`` and ``gen_eplb``: the loader reads
    SGLang's live map at connect and at every refit (tests/unit/test_wide_ep_eplb_sglang_map.py); a TP
    rank given to a DP-attention deployment is refused by name with no model (None here)."""
    from megatron_refit.config.deployment import refuse_wide_ep
    from megatron_refit.engines.sglang.worker.loader import engine_refit_for
    from megatron_refit.registry import engine_named

    assert engine_named("sglang").wide_ep == ("gen_attention_dp", "gen_redundant_experts", "gen_eplb")
    refuse_wide_ep(_cfg(gen_eplb=True, gen_redundant_experts=4))  # nothing to refuse
    with pytest.raises(ValueError, match=r"tp_rank=0 names a TP rank of an engine without DP attention"):
        engine_refit_for(None, {"gen_tp": 2, "gen_attention_dp": 2, "gen_expert_parallel": True, "gen_eplb": True},
                         num_train=2, tp_rank=0)
