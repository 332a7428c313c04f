"""Megatron train ranks (real bf16 optimizer steps at an RL learning rate, sequence parallel) refit
into one wide expert-parallel deployment of D2 x T2 with EP4 (#64), through the real refit groups over gloo:
attention at TP rank ``i % 2`` on both data-parallel ranks, every physical expert slot
(redundant ones included, an expert twice on one rank) filled with its logical expert, the map
permuted and then **moved between refits** (an EPLB rebalance while the engine serves: its ranks
read the moved map at the next refit, the group re-plans the experts in its handshake and the refit
lands in the new map; or the engine ranks rejoin with it). Every refit bit-exact against
Bridge's ``export_hf_weights``, each engine rank receiving exactly its bytes once
(``bytes_sent == bytes_minimal``)."""

from __future__ import annotations

import pytest

from megatron_refit.plan.expert_placement import ExpertPlacement
from megatron_refit.plan.gen_layout import GenLayout
from megatron_refit.plan.layout import TrainLayout
from megatron_refit.local.evaluate import evaluate
from megatron_refit.local.fused_engine import rebalanced
from megatron_refit.local.harness import RunSpec, run

pytestmark = pytest.mark.slow

LAYERS = 2
SP = dict(tp=2, ep=2, sequence_parallel=True)
"""Train TP2 x EP2 with sequence parallelism, as Bridge's MoE recipes run TP > 1."""


def _deployment(experts: int, redundant: int, tp: int = 2) -> GenLayout:
    first = rebalanced(ExpertPlacement(num_logical_experts=experts, ep_size=2 * tp, num_redundant=redundant), 0,
                       layers=LAYERS)
    return GenLayout(tp=tp, attention_dp=2, expert_parallel=True, placement=first)


CASES = [
    # 8 experts top-2, 2 redundant: 10 slots over 4 ranks (3, 3, 2, 2), an expert twice on rank 0
    ("8e-top2-r2-tp2ep2", dict(experts=8, num_experts_per_tok=2), TrainLayout(**SP), 2, 2),
    # 64 experts top-8, 4 redundant (68 / 4 = 17 slots a rank, as vLLM's EPLB needs), PP2
    ("64e-top8-r4-tp2ep2pp2", dict(experts=64, num_experts_per_tok=8, vocab=512), TrainLayout(**SP, pp=2), 4,
     2),
    # attention TP1 (D2 x T1, EP2: public DP+EP runs): each rank holds every dense weight whole
    ("8e-top2-r2-tp2ep2-to-d2t1", dict(experts=8, num_experts_per_tok=2), TrainLayout(**SP), 2, 1),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_wide_ep_refit_bit_exact(case):
    """EPLB moves the experts in place after refit 2 (their old bytes scrambled): refit 3 re-plans
    them in the group's handshake and lands in the moved map."""
    _check_moved(case, rejoin=False)


def test_engine_ranks_that_rejoin_with_a_moved_map():
    """The same move, the deployment's engine ranks leaving and rejoining with the new map (a
    restarted engine): the train ranks re-plan at the join."""
    _check_moved(CASES[0], rejoin=True)


def _check_moved(case, *, rejoin: bool):
    _, overrides, train, redundant, tp = case
    experts = overrides["experts"]
    gen = _deployment(experts, redundant, tp)
    spec = RunSpec(model="qwen3-moe", overrides=dict(overrides, layers=LAYERS), train=train, gen=gen, refits=3,
                   dtype="bfloat16", lr=1e-6, bucket_bytes=64 << 10, remap=(2,), remap_rejoin=rejoin)
    result = evaluate(spec, run(spec))
    assert result["gen"] == dict(tp=tp, dp=1, attention_dp=2)
    for r in result["refits"]:
        assert r["bit_exact"] is True, r["version"]
        assert r["bytes_sent"] == r["bytes_minimal"] > 0, r
        assert r["failed_replicas"] == {}
    moved = spec.gen_at(3, LAYERS).placement
    assert moved.physical_to_logical != gen.placement.physical_to_logical  # refit 3 landed in another map
    # the train ranks re-planned only the moved experts (RefitPlan.replanned), agreed by the
    # engine ranks' full builds; the refits before it ran on the first full build
    assert [r["replanned"] for r in result["refits"]] == [[False] * train.world_size] * 2 + [
        [True] * train.world_size], [r["replanned"] for r in result["refits"]]
    # in place: once, in refit 3's handshake (a rejoin re-plans at the join instead)
    assert [r["replans"] for r in result["refits"]] == [[0] * train.world_size] * 2 + [
        [0 if rejoin else 1] * train.world_size], [r["replans"] for r in result["refits"]]
    assert result["refits"][0]["loss"] != result["refits"][1]["loss"]


def test_one_data_parallel_rank_fails_its_deployment_only():
    """Two deployments of D2 x T2; data-parallel rank 1's TP rank 0 (deployment rank 2) of
    deployment 1 raises while refit 2 lands: deployment 1 fails by name, deployment 0 lands it
    bit-exact, and refit 3 brings deployment 1 back in full."""
    gen = GenLayout(tp=2, dp=2, attention_dp=2, expert_parallel=True,
                    placement=_deployment(8, 0).placement)
    spec = RunSpec(model="qwen3-moe", overrides=dict(experts=8, num_experts_per_tok=2, layers=LAYERS),
                   train=TrainLayout(**SP), gen=gen, refits=3, dtype="bfloat16", lr=1e-6,
                   bucket_bytes=64 << 10, fail_replica=(1, 2), fail_rank=2)
    results = run(spec)
    result = evaluate(spec, results)
    failed = [r["failed_replicas"] for r in result["refits"]]
    assert [sorted(map(int, f)) for f in failed] == [[], [1], []], failed
    assert failed[1][1].startswith("rank 2 (DP rank 1, TP rank 0): RuntimeError: engine error"), failed[1]
    # deployment 0 landed refit 2 bit-exact (deployment 1's ranks are not checked there), both landed 3
    assert [r["bit_exact"] for r in result["refits"]] == [True, True, True]
    gens = [g for g in results if g["role"] == "gen"]
    assert [g["refits"][1]["report"] is None for g in gens] == [False] * 6 + [True, False]
    assert all(g["refits"][2]["report"]["failed_replicas"] == {} for g in gens)


def test_a_map_of_other_slots_fails_its_deployment_by_name_before_any_byte_moves():
    """Two deployments of D2 x T2 whose experts move in place after refit 2; deployment 1's
    balancer then reports a map of other slots (more redundant experts than it was connected
    with): its refit 3 fails by name on every one of its ranks before any byte moves (no engine
    rank of it has a report), while deployment 0 re-plans its moved experts and lands bit-exact."""
    gen = GenLayout(tp=2, dp=2, attention_dp=2, expert_parallel=True, placement=_deployment(8, 2).placement)
    spec = RunSpec(model="qwen3-moe", overrides=dict(experts=8, num_experts_per_tok=2, layers=LAYERS),
                   train=TrainLayout(**SP), gen=gen, refits=3, dtype="bfloat16", lr=1e-6,
                   bucket_bytes=64 << 10, remap=(2,), bad_map=1)
    results = run(spec)
    result = evaluate(spec, results)
    failed = [r["failed_replicas"] for r in result["refits"]]
    assert [sorted(map(int, f)) for f in failed] == [[], [], [1]], failed
    assert "the engine's live expert map has num_redundant=10, the refit planned 2" in failed[2][1], failed[2]
    assert [r["bit_exact"] for r in result["refits"]] == [True, True, True]  # deployment 1 not checked at 3
    gens = [g for g in results if g["role"] == "gen"]
    assert [g["refits"][2]["report"] is None for g in gens] == [False] * 4 + [True] * 4
    errors = [g["refits"][2]["error"] for g in gens[4:]]
    assert all("live expert map has num_redundant=10" in e or e.startswith("RefitAbortedError") for e in errors), errors
    assert result["refits"][2]["replans"] == [1] * 2  # deployment 0's handshake re-planned; 1's ended first


@pytest.mark.parametrize("tp, node_ranks, redundant", [(1, 2, 2), (2, 4, 0)], ids=["d2t1-node2", "d2t2-node4"])
def test_dense_rows_split_over_a_node_and_forwarded_land_bit_exact(tp, node_ranks, redundant):
    """``refit.gen_dense_forward: node``: the two DP ranks of each TP rank share a node; each takes half
    of every dense shard's rows from the train ranks and passes them to the other, EPLB moving the
    experts after refit 2 too. Every refit bit-exact; the train ranks send each dense byte once per
    deployment (bytes sent = the minimal: what the engine ranks take from them), the two DP ranks of a
    TP rank together as much as one of them without forwarding."""
    gen = _deployment(8, redundant, tp)
    train = TrainLayout(**SP)
    spec = RunSpec(model="qwen3-moe", overrides=dict(experts=8, num_experts_per_tok=2, layers=LAYERS), train=train,
                   gen=gen, refits=3, dtype="bfloat16", lr=1e-6, bucket_bytes=64 << 10, remap=(2,),
                   dense_forward=node_ranks)
    results = run(spec)
    result = evaluate(spec, results)
    for r in result["refits"]:
        assert r["bit_exact"] is True and r["failed_replicas"] == {}, r
        assert r["bytes_sent"] == r["bytes_minimal"] > 0, r
    direct = RunSpec(**{**spec.__dict__, "dense_forward": 0, "refits": 1, "remap": ()})
    plain = evaluate(direct, run(direct))["refits"][0]
    assert result["refits"][0]["bytes_sent"] < plain["bytes_sent"]
    gens = [g for g in results if g["role"] == "gen"]
    received = [g["refits"][0]["report"]["bytes_received"] for g in gens]
    assert sum(received) == result["refits"][0]["bytes_sent"]


def test_forwarded_rows_corrupted_on_the_way_fail_their_deployment_by_name():
    """Two D2 x T1 deployments; deployment 1's rank 0 (engine rank 2) forwards rows that arrive with a
    byte flipped at refit 2: its node-group peer fails with a RefitCorruptionError naming it,
    deployment 1's refit fails by name, deployment 0 lands it bit-exact, and refit 3 lands both."""
    gen = GenLayout(tp=1, dp=2, attention_dp=2, expert_parallel=True, placement=_deployment(8, 2, 1).placement)
    spec = RunSpec(model="qwen3-moe", overrides=dict(experts=8, num_experts_per_tok=2, layers=LAYERS),
                   train=TrainLayout(**SP), gen=gen, refits=3, dtype="bfloat16", lr=1e-6, bucket_bytes=64 << 10,
                   dense_forward=2, corrupt_forward=2)
    result = evaluate(spec, run(spec))
    failed = [r["failed_replicas"] for r in result["refits"]]
    assert [sorted(map(int, f)) for f in failed] == [[], [1], []], failed
    assert "RefitCorruptionError: engine rank 1: the dense rows forwarded by its node-group peer, engine rank 0, " \
           "changed on the way" in failed[1][1], failed[1]
    assert [r["bit_exact"] for r in result["refits"]] == [True, True, True]  # deployment 1 not checked at 2


def test_forwarded_fp8_weights_and_their_scale_tiles_split_alike():
    """Trainer-side FP8 under ``gen_dense_forward: node`` (D2 x T1, both DP ranks on one node): each
    dense FP8 weight splits at whole 128-row tiles, its ``scale_inv`` at the same tiles; bit-exact."""
    aligned = dict(hidden=256, heads=4, kv_heads=2, head_dim=128, ffn=256, moe_ffn=128, vocab=512)
    gen = _deployment(8, 2, 1)
    spec = RunSpec(model="qwen3-moe", overrides=dict(aligned, experts=8, num_experts_per_tok=2, layers=LAYERS),
                   train=TrainLayout(**SP), gen=gen, refits=2, dtype="bfloat16", lr=1e-6, bucket_bytes=64 << 10,
                   fp8="trainer", dense_forward=2)
    result = evaluate(spec, run(spec))
    for r in result["refits"]:
        assert r["bit_exact"] is True and r["bytes_sent"] == r["bytes_minimal"] > 0, r


def test_delta_refits_around_an_expert_move_stay_bit_exact():
    """``refit.delta: on`` with EPLB moving the experts after refit 2: refit 2 is a delta, refit 3 is
    re-planned in its handshake and sent in full (every engine rank's experts moved here, so each
    shows no delta base; a re-plan also sends full on pairs whose ranks did not move and drops the
    senders' copies of the old plan's buckets), refit 4 a delta again from the new plan's copies;
    all bit-exact."""
    gen = _deployment(8, 2)
    spec = RunSpec(model="qwen3-moe", overrides=dict(experts=8, num_experts_per_tok=2, layers=LAYERS),
                   train=TrainLayout(**SP), gen=gen, refits=4, dtype="bfloat16", lr=1e-6, bucket_bytes=64 << 10,
                   remap=(2,), delta="on")
    result = evaluate(spec, run(spec))
    assert [r["bit_exact"] for r in result["refits"]] == [True] * 4, [r["failed_replicas"] for r in result["refits"]]
    assert [r["delta"] for r in result["refits"]] == [False, True, False, True]
    assert [r["replans"] for r in result["refits"]][2] == [1] * 2


def test_a_node_group_peer_whose_own_refit_failed_fails_the_others_by_name():
    """Two D2 x T1 deployments under ``gen_dense_forward: node``; deployment 1's DP rank 0 raises an
    engine error while refit 2 lands (its bytes drained, not written): it still takes part in the
    exchange, telling its peer that its rows are not this version's, so the peer fails by name
    instead of serving them; deployment 0 lands, and refit 3 lands both."""
    gen = GenLayout(tp=1, dp=2, attention_dp=2, expert_parallel=True, placement=_deployment(8, 2, 1).placement)
    spec = RunSpec(model="qwen3-moe", overrides=dict(experts=8, num_experts_per_tok=2, layers=LAYERS),
                   train=TrainLayout(**SP), gen=gen, refits=3, dtype="bfloat16", lr=1e-6, bucket_bytes=64 << 10,
                   dense_forward=2, fail_replica=(1, 2), fail_rank=0)
    result = evaluate(spec, run(spec))
    failed = [r["failed_replicas"] for r in result["refits"]]
    assert [sorted(map(int, f)) for f in failed] == [[], [1], []], failed
    assert "rank 0 (DP rank 0, TP rank 0): RuntimeError: engine error" in failed[1][1], failed[1]
    assert "rank 1 (DP rank 1, TP rank 0): RefitCorruptionError: engine rank 1: the dense rows forwarded by its " \
           "node-group peer, engine rank 0, are not this version's" in failed[1][1], failed[1]
    assert [r["bit_exact"] for r in result["refits"]] == [True, True, True]
