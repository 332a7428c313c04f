"""The ``refit:`` keys of a wide expert-parallel engine deployment (#64 item 6): validated by name,
resolved into a ``GenLayout`` as the engine resolves its expert placement, and refused by name where a
refit starts (the train ranks' and every engine's), since no engine receives into one yet."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_refit.config import RefitConfig
from megatron_refit.config.deployment import WIDE_EP_KEYS, deployment_layout, refuse_wide_ep
from megatron_refit.plan.expert_placement import rank_slots
from megatron_refit.plan.gen_layout import GenLayout
from megatron_refit.registry import Engine, engine_names, register_engine

WIDE = {"enabled": True, "gen_tp": 8, "gen_attention_dp": 16, "gen_expert_parallel": True}

if "no_wide_ep" not in engine_names():  # an engine of vLLM's layout that declares no wide-EP key
    register_engine(Engine(name="no_wide_ep", writes="declares no wide expert-parallel key"))


def test_defaults_keep_the_replica_layout():
    config = RefitConfig.from_dict({"enabled": True, "gen_tp": 4, "gen_dp": 3, "gen_expert_parallel": True})
    assert (config.gen_attention_dp, config.gen_expert_placement, config.gen_redundant_experts, config.gen_eplb) == (
        1, "linear", 0, False)
    assert config.gen_world_size == 12
    # gen_dp * gen_tp as before: no placement where it would be vLLM's initial map over gen_tp ranks
    assert config.gen_layout(num_experts=8) == GenLayout(tp=4, dp=3, expert_parallel=True)
    assert config.replica_layout(num_experts=8) == GenLayout(tp=4, dp=1, expert_parallel=True)
    assert config.gen_layout() == GenLayout(tp=4, dp=3, expert_parallel=True)
    refuse_wide_ep(config)  # nothing to refuse


def test_a_deployment_of_data_parallel_ranks():
    config = RefitConfig.from_dict({**WIDE, "gen_dp": 2})
    assert config.gen_world_size == 256
    layout = config.gen_layout(num_experts=384, num_expert_group=1)  # Kimi-K2
    assert (layout.tp, layout.attention_dp, layout.dp, layout.deployment_size) == (8, 16, 2, 128)
    assert layout.placement.ep_size == 128 and layout.placement.strategy == "linear"
    assert rank_slots(layout.placement, 5) == (15, 16, 17)  # 3 experts per rank
    assert config.replica_layout(num_experts=384).dp == 1
    # a dense model: no placement; its data-parallel ranks hold what replicas would
    assert config.gen_layout().placement is None


def test_redundant_experts_under_eplb():
    config = RefitConfig.from_dict({"enabled": True, "gen_tp": 1, "gen_attention_dp": 32, "gen_expert_parallel": True,
                                    "gen_eplb": True, "gen_redundant_experts": 32, "gen_dp": 8})
    deployment = deployment_layout(config, replicas=8, num_experts=256, num_expert_group=8)  # DeepSeek-V3
    placement = deployment.layout.placement
    assert (placement.num_physical, placement.ep_size, len(rank_slots(placement, 0))) == (288, 32, 9)
    assert placement.layer_map(0)[256:] == tuple(range(32))  # EPLB's initial map: slot p holds p % E
    assert deployment.describe("vllm") == "vllm D32xT1, EP32 (linear, 32 redundant experts) x 8 = 256 ranks"
    # vLLM's EPLB needs the EP size to divide the physical experts
    with pytest.raises(ValueError, match="ep_size=64 does not divide the 288 physical experts"):
        RefitConfig.from_dict({**WIDE, "gen_tp": 4, "gen_eplb": True, "gen_redundant_experts": 32}).gen_layout(256, 8)


@pytest.mark.parametrize("section, groups, strategy, why", [
    ({**WIDE, "gen_attention_dp": 1}, 8, "round_robin", ""),  # TP8 EP8, DeepSeek's 8 groups: kept
    ({**WIDE, "gen_attention_dp": 1}, 1, "linear", "no expert groups"),  # Kimi-K2: n_group 1
    (WIDE, 8, "linear", "default all2all backend allgather_reducescatter"),  # all2all kernels with DP ranks
    ({**WIDE, "gen_eplb": True}, 8, "linear", "redundant experts or EPLB"),
])
def test_round_robin_falls_back_as_vllm_does(section, groups, strategy, why):
    config = RefitConfig.from_dict({**section, "gen_expert_placement": "round_robin"})
    deployment = deployment_layout(config, replicas=1, num_experts=256, num_expert_group=groups)
    assert deployment.strategy == strategy and why in deployment.fallback and bool(why) == bool(deployment.fallback)
    placement = deployment.layout.placement  # None: vLLM's linear map over gen_tp ranks, as without the key
    assert (placement.strategy if placement is not None else "linear") == strategy


def test_sglang_places_contiguous_blocks():
    config = RefitConfig.from_dict({**WIDE, "engine": "sglang", "gen_redundant_experts": 128})  # SGLang: no EPLB needed
    placement = config.gen_layout(num_experts=384).placement
    assert (placement.num_physical, placement.strategy, rank_slots(placement, 1)) == (512, "linear", (4, 5, 6, 7))
    with pytest.raises(ValueError, match="ep_size=128 does not divide the 500 physical experts"):
        RefitConfig.from_dict({**WIDE, "engine": "sglang", "gen_redundant_experts": 116}).gen_layout(384)


@pytest.mark.parametrize("section, match", [
    ({"gen_attention_dp": 0}, r"refit.gen_attention_dp must be positive, got 0"),
    ({"gen_attention_dp": 2.0}, r"refit.gen_attention_dp: expected int, got 2.0"),
    ({"gen_eplb": "yes"}, r"refit.gen_eplb: expected bool, got 'yes'"),
    ({"gen_expert_placement": "random"},
     r"refit.gen_expert_placement: 'random' is not one of \['linear', 'round_robin'\]"),
    ({"gen_redundant_experts": -1}, r"refit.gen_redundant_experts must be >= 0, got -1"),
    ({"gen_redundant_experts": 2, "gen_eplb": True}, r"refit.gen_redundant_experts=2 places whole experts: it needs "
                                                     r"gen_expert_parallel: true"),
    ({"gen_expert_placement": "round_robin"}, r"refit.gen_expert_placement='round_robin' places whole experts"),
    ({"gen_eplb": True}, r"refit.gen_eplb=True places whole experts"),
    ({"gen_expert_parallel": True, "gen_tp": 2, "gen_redundant_experts": 2},
     r"refit.gen_redundant_experts=2: vLLM holds redundant experts only under EPLB \(set gen_eplb: true\)"),
    ({"gen_expert_parallel": True, "gen_eplb": True}, r"refit.gen_eplb: vLLM balances experts over more than one rank"),
    ({"engine": "sglang", "gen_expert_parallel": True, "gen_tp": 2, "gen_expert_placement": "round_robin"},
     r"refit.gen_expert_placement='round_robin': SGLang places its physical experts in contiguous blocks"),
    ({"engine": "hf", "gen_attention_dp": 2}, r"refit.gen_attention_dp=2: engine 'hf' holds whole tensors on one rank "
                                              r"per replica; more ranks are more replicas \(gen_dp\)"),
])
def test_bad_deployment_keys_are_named(section, match):
    with pytest.raises(ValueError, match=match):
        RefitConfig.from_dict({"enabled": True, **section})


@pytest.mark.parametrize("key, value, shown", [("gen_attention_dp", 16, "1"), ("gen_redundant_experts", 32, "0"),
                                               ("gen_eplb", True, "false"), ("gen_expert_placement", "round_robin",
                                                                             "linear")])
def test_every_wide_key_is_refused_where_a_refit_starts(key, value, shown):
    section = {**WIDE, "gen_attention_dp": 1, "gen_tp": 8, key: value, "engine": "no_wide_ep"}
    if key == "gen_redundant_experts":
        section["gen_eplb"] = True
    config = RefitConfig.from_dict(section)
    assert key in WIDE_EP_KEYS
    refused = (rf"refit.{key}={value!r}: engine 'no_wide_ep' does not receive into that wide expert-parallel "
               rf"deployment yet \(#64\): the dry run and the cost model plan it .*; to refit now set {key}: {shown}$")
    with pytest.raises(ValueError, match=refused):
        refuse_wide_ep(config)
    # where both sides start: train ranks (trainer_refit_from_pieces) and engines (engine_refit, HF's too)
    from megatron_refit.group.connect import check_enabled

    with pytest.raises(ValueError, match=refused):
        check_enabled(config, 4)


def test_engine_entry_points_refuse_before_touching_the_engine():
    """The generic engine entry (``engine_refit``, for an engine that declares no wide-EP key) and SGLang's
    loader (which receives every wide key but round-robin placement, which SGLang has not) refuse before
    any group, storage or model is used (None here); vLLM's worker: tests/engines/vllm/test_weight_transfer.py
    (it imports vLLM)."""
    from megatron_refit.engine_side.entry import engine_refit
    from megatron_refit.engines.sglang.worker.loader import engine_refit_for

    config = RefitConfig.from_dict({**WIDE, "gen_tp": 1, "gen_attention_dp": 2, "engine": "no_wide_ep"})
    with pytest.raises(ValueError, match=r"refit.gen_attention_dp=2: engine 'no_wide_ep' does not receive into that"):
        engine_refit(config, None, gen_index=0, num_train=2)
    with pytest.raises(ValueError, match=r"refit.gen_expert_placement='round_robin': SGLang places its physical"):
        engine_refit_for(None, {**WIDE, "gen_tp": 1, "gen_expert_placement": "round_robin"}, num_train=2, tp_rank=0)


def test_an_engine_that_declares_the_keys_is_not_refused():
    """What an engine receives into is its declaration (``Engine.wide_ep``): the harness's ``fused``
    engine and vLLM take every key (vLLM's worker reads EPLB's live map), a refit of them starts; the
    same keys with an engine that declares none are refused by name."""
    from megatron_refit.group.connect import check_enabled
    from megatron_refit.local.fused_engine import NAME

    section = {**WIDE, "gen_tp": 2, "gen_attention_dp": 2, "gen_redundant_experts": 4, "gen_eplb": True}
    check_enabled(RefitConfig.from_dict({**section, "engine": NAME}), 2)
    check_enabled(RefitConfig.from_dict(section), 2)
    with pytest.raises(ValueError, match=r"refit.gen_attention_dp=2: engine 'no_wide_ep' does not receive"):
        check_enabled(RefitConfig.from_dict({**section, "engine": "no_wide_ep"}), 2)


def test_the_dry_run_says_which_shipped_deployment_a_refit_refuses():
    """Before a job starts: Kimi-K2's DP16 x TP8 vLLM deployment and DeepSeek-V3's with EPLB and 32 redundant
    experts are both received into (no key refused); an engine that declares no key is refused by key."""
    import os

    from megatron_refit.config.deployment import refused_key
    from megatron_refit.tools.dryrun import load_config

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    kimi, _, _ = load_config(os.path.join(root, "configs", "kimi-k2-fp8-256to128.yaml"))
    deepseek, _, _ = load_config(os.path.join(root, "configs", "deepseek-v3-wide-ep.yaml"))
    assert kimi.gen_attention_dp == 16 and refused_key(kimi) is None
    assert refused_key(deepseek) is None and deepseek.gen_eplb and deepseek.gen_redundant_experts == 32
    refuse_wide_ep(deepseek)
    other = dataclasses.replace(deepseek, engine="no_wide_ep")
    assert refused_key(other) == "gen_attention_dp"
