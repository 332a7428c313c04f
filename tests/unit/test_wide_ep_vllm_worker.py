"""The vLLM worker's side of a wide expert-parallel deployment, without vLLM (#64): its engine rank from
vLLM's parallel state (a MoE model's data-parallel ranks are one deployment, a dense model's replicas),
and its live FusedMoE ``expert_map`` held to the plan's, refused by name where they differ. The real
worker into vLLM's own FusedMoE: tests/engines/vllm/test_wide_ep_weight_transfer.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_refit.config import RefitConfig
from megatron_refit.engines.vllm.worker.expert_maps import check_expert_maps
from megatron_refit.engines.vllm.worker.rank import engine_rank
from megatron_refit.plan.expert_placement import ExpertPlacement, expert_map


def _parallel(tp=2, dp=1, dp_rank=0, ep=True):
    return SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1, enable_expert_parallel=ep,
                           data_parallel_size=dp, data_parallel_rank=dp_rank, data_parallel_index=dp_rank)


def _cfg(**kw):
    return RefitConfig.from_dict({"enabled": True, "gen_tp": 2, "gen_expert_parallel": True, **kw})


def test_a_moe_models_data_parallel_ranks_are_one_deployment():
    cfg = _cfg(gen_attention_dp=2, gen_dp=2)
    ranks = [engine_rank(cfg, _parallel(dp=2, dp_rank=d), replica=r, tp_rank=lambda t=t: t, moe=True)
             for r in (None, 1) for d in (0, 1) for t in (0, 1)]
    assert ranks == [0, 1, 2, 3, 4, 5, 6, 7]


def test_a_dense_models_data_parallel_ranks_are_replicas():
    cfg = _cfg(gen_dp=2)
    assert [engine_rank(cfg, _parallel(dp=2, dp_rank=d), replica=None, tp_rank=lambda: 1, moe=False)
            for d in (0, 1)] == [1, 3]


@pytest.mark.parametrize("kw, parallel, moe, match", [
    (dict(gen_attention_dp=4), _parallel(dp=2), True, r"gen_attention_dp=4, but this vLLM engine runs a MoE model at "
                                                       r"data_parallel_size=2"),
    (dict(gen_attention_dp=2), _parallel(dp=1), True, r"gen_attention_dp=2, but this vLLM engine runs "
                                                       r"data_parallel_size=1 of a MoE model"),
    (dict(gen_attention_dp=2), _parallel(dp=2), False, r"data_parallel_size=2 of a dense model"),
    ({}, _parallel(tp=4), True, r"gen_tp=2, but this vLLM engine runs tensor_parallel_size=4"),
    ({}, _parallel(ep=False), True, r"gen_expert_parallel=True, but this vLLM engine runs enable_expert_parallel"),
])
def test_a_deployment_the_engine_does_not_run_is_named_before_vllms_groups_are_asked(kw, parallel, moe, match):
    def not_asked():
        raise AssertionError("the TP rank was asked before the checks")

    with pytest.raises(ValueError, match=match):
        engine_rank(_cfg(**kw), parallel, replica=None, tp_rank=not_asked, moe=moe)


class _Layer(torch.nn.Module):
    def __init__(self, emap, local):
        super().__init__()
        self.expert_map = None if emap is None else torch.tensor(emap, dtype=torch.int32)
        self.w13_weight = torch.nn.Parameter(torch.zeros(local, 4, 2))


def _model(*layers):
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(layers)
    return model


def test_vllms_expert_map_is_held_to_the_plans():
    placement = ExpertPlacement(num_logical_experts=8, ep_size=4)
    emap = list(expert_map(placement, 2))
    assert check_expert_maps(_model(_Layer(emap, 2), _Layer(emap, 2)), placement, 2) == 2
    rr = ExpertPlacement(num_logical_experts=8, ep_size=4, strategy="round_robin")
    with pytest.raises(ValueError, match=r"layers\.0: vLLM's expert_map on deployment rank 2 is \[-1, -1, -1, -1, "
                                         r"0, 1, -1, -1\], the refit plans \[-1, -1, 0, -1, -1, -1, 1, -1\] "
                                         r"\(round_robin"):
        check_expert_maps(_model(_Layer(emap, 2)), rr, 2)
    with pytest.raises(ValueError, match=r"layers\.1: w13_weight holds 3 experts on deployment rank 2, the "
                                         r"expert map 2"):
        check_expert_maps(_model(_Layer(emap, 2), _Layer(emap, 3)), placement, 2)
    with pytest.raises(ValueError, match=r"has no FusedMoE layer"):
        check_expert_maps(torch.nn.Linear(2, 2), placement, 0)
    one = ExpertPlacement(num_logical_experts=8, ep_size=1)
    assert check_expert_maps(_model(_Layer(None, 8)), one, 0) == 1  # vLLM keeps no map at EP size 1
