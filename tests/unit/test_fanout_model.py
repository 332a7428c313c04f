"""Replica fan-out as a transfer graph and its cost (megatron_refit.plan.fanout, plan.cost), on
hand-computed cases."""

from __future__ import annotations

import pytest

from megatron_refit.plan.cost import Cluster, fanout_prediction, placement, predict
from megatron_refit.plan.fanout import depth, fanout_routes, successors

GB = 10**9


def _routes(num_train: int, tp: int, dp: int, per_route: int) -> dict[tuple[int, int], int]:
    """Every train rank sends ``per_route`` bytes to every gen rank of every replica."""
    return {(t, g): per_route for t in range(num_train) for g in range(tp * dp)}


def test_a_chain_takes_from_the_trainers_once_and_relays_rank_k_to_rank_k():
    routes = fanout_routes(_routes(2, tp=2, dp=3, per_route=5), tp=2, dp=3, mode="chain")
    assert routes.from_trainers == {(t, g): 5 for t in range(2) for g in range(2)}  # replica 0 only
    assert routes.relays == {(0, 2): 10, (1, 3): 10, (2, 4): 10, (3, 5): 10}
    assert routes.bytes_from_trainers == 20 and routes.bytes_relayed == 40 and routes.depth == 2


def test_a_tree_is_shallower_but_a_relay_sends_twice_what_it_receives():
    assert [successors(r, 7, "tree") for r in range(7)] == [[1, 2], [3, 4], [5, 6], [], [], [], []]
    assert depth(7, "tree") == 2 and depth(8, "tree") == 3 and depth(8, "chain") == 7 and depth(1, "chain") == 0
    routes = fanout_routes(_routes(1, tp=1, dp=7, per_route=3), tp=1, dp=7, mode="tree")
    out = {}
    for (src, _), nbytes in routes.relays.items():
        out[src] = out.get(src, 0) + nbytes
    assert out == {0: 6, 1: 6, 2: 6}


def test_one_replica_relays_nothing_and_costs_what_direct_does():
    cluster = Cluster()
    pairs = _routes(2, tp=2, dp=1, per_route=GB)
    routes = fanout_routes(pairs, tp=2, dp=1, mode="chain")
    assert routes.relays == {} and routes.depth == 0
    train_gpu, gen_gpu = placement(2, 2, "disaggregated", 8)
    direct = predict(pairs, train_gpu, gen_gpu, cluster, bucket_bytes=1 << 29)
    assert fanout_prediction(routes, train_gpu, gen_gpu, cluster, bucket_bytes=1 << 29) == direct


def test_where_the_trainers_link_is_the_bottleneck_a_chain_takes_it_off():
    """One train GPU, four one-GPU replicas on other nodes, 4 GB each: direct sends 16 GB through
    the train GPU's NIC (0.4 s at 40 GB/s); a chain sends 4 GB once (0.1 s), each relay forwards
    4 GB while it receives (in and out in parallel), plus 3 hops of one 0.5 GB bucket each."""
    cluster = Cluster(gpus_per_node=1)
    pairs = _routes(1, tp=1, dp=4, per_route=4 * GB)
    train_gpu, gen_gpu = placement(1, 4, "disaggregated", 1)
    direct = predict(pairs, train_gpu, gen_gpu, cluster, bucket_bytes=GB // 2)
    assert direct.seconds == pytest.approx(16 / 40 + 32 * 20e-6)
    routes = fanout_routes(pairs, tp=1, dp=4, mode="chain")
    chain = fanout_prediction(routes, train_gpu, gen_gpu, cluster, bucket_bytes=GB // 2)
    relay_gpu = 4 / 40 + 16 * 20e-6  # in 4 GB and out 4 GB in parallel; 8 + 8 messages
    fill = 3 * (0.5 / 40 + 20e-6)
    assert chain.seconds == pytest.approx(relay_gpu + fill)
    assert chain.seconds < direct.seconds / 2  # 0.138 s against 0.401 s
    assert "3 hop(s) of pipeline fill" in chain.bottleneck


def test_where_the_receivers_link_is_the_bottleneck_fanout_only_adds_the_fill():
    """As many train GPUs as gen GPUs (the shipped configs): direct already runs at each gen rank's
    NIC floor, so a chain is slower by its fill and a tree by a relay's doubled egress."""
    cluster = Cluster(gpus_per_node=1)
    pairs = _routes(4, tp=1, dp=4, per_route=GB)  # each train GPU sends 4 GB, each gen GPU takes 4 GB
    train_gpu, gen_gpu = placement(4, 4, "disaggregated", 1)
    direct = predict(pairs, train_gpu, gen_gpu, cluster, bucket_bytes=GB // 2)
    chain = fanout_prediction(fanout_routes(pairs, tp=1, dp=4, mode="chain"), train_gpu, gen_gpu, cluster,
                              bucket_bytes=GB // 2)
    tree = fanout_prediction(fanout_routes(pairs, tp=1, dp=4, mode="tree"), train_gpu, gen_gpu, cluster,
                             bucket_bytes=GB // 2)
    assert direct.seconds < chain.seconds < tree.seconds


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="fan-out mode must be one of \\['chain', 'tree'\\], got 'ring'"):
        fanout_routes({}, tp=1, dp=2, mode="ring")
    with pytest.raises(ValueError, match="route to gen rank 4 outside tp=2 x dp=2"):
        fanout_routes({(0, 4): 1}, tp=2, dp=2, mode="chain")
    with pytest.raises(ValueError, match="replica 1 rank 0 receives 2 bytes, replica 0 rank 0 1"):
        fanout_routes({(0, 0): 1, (0, 2): 2, (0, 1): 1, (0, 3): 1}, tp=2, dp=2, mode="chain")


# -- refit.fanout at run time: routes, auto, the router's decisions ---------------------------

def test_relay_placements_put_replicas_in_a_chain_or_a_tree_in_the_order_given():
    from megatron_refit.plan.fanout import relay_placements

    assert relay_placements([2, 0, 5], "chain") == {2: (-1, (0,)), 0: (2, (5,)), 5: (0, ())}
    assert relay_placements([0, 1, 2, 3], "tree") == {0: (-1, (1, 2)), 1: (0, (3,)), 2: (0, ()), 3: (1, ())}
    with pytest.raises(ValueError, match=r"relay_placements: replicas \[1, 1\] repeat"):
        relay_placements([1, 1], "chain")


def test_a_route_travels_as_six_ints_and_back():
    from megatron_refit.plan.fanout import DIRECT, PLACEMENT_VALUES, Placement

    for route in (DIRECT, Placement(3, 7, (4,), 12), Placement(-1, 2, (1, 2), -1)):
        values = route.values()
        assert len(values) == PLACEMENT_VALUES and Placement.from_values(values) == route
    assert not DIRECT.relayed and Placement(0, 1).relayed


def test_auto_sends_direct_where_the_trainers_link_is_no_bottleneck_and_chains_where_it_is():
    from megatron_refit.plan.fanout import auto_mode, resolve_mode

    mb = 1 << 20
    assert auto_mode(10 * mb, 10 * mb, 1, 4 * mb) == "off"  # one replica: nothing to relay
    assert auto_mode(10 * mb, 40 * mb, 2, 4 * mb) == "off"  # trainers send 20, a chain's relay 40
    assert auto_mode(10 * mb, 10 * mb, 4, 4 * mb) == "chain"  # 40 direct, 10 + 3 buckets chained
    assert auto_mode(64 * mb, 4 * mb, 16, 4 * mb) == "tree"  # 16 hops of fill against 4
    pairs = {(t, g): 5 * mb for t in range(2) for g in range(2 * 4)}  # 2 train ranks, TP2 x DP4
    assert resolve_mode("auto", pairs, tp=2, dp=4, bucket_bytes=4 * mb) == auto_mode(10 * mb, 10 * mb, 4, 4 * mb)
    assert resolve_mode("tree", pairs, tp=2, dp=4, bucket_bytes=4 * mb) == "tree"
    with pytest.raises(ValueError, match="refit.fanout must be one of"):
        resolve_mode("ring", pairs, tp=2, dp=4, bucket_bytes=4 * mb)


class _Endpoint:
    def __init__(self, plan, base):
        self.plan, self._base = plan, base
        self.plan_id = plan  # equal plans, equal ids (the plan's shared fingerprint)

    def delta_base(self):
        return self._base


class _Member:
    def __init__(self, plan, base=-1):
        self.ep = _Endpoint(plan, base)

    def endpoint(self, full):
        return self.ep


def test_the_router_chains_replicas_of_one_plan_and_version_heads_the_one_with_copies_and_counts_epochs():
    from megatron_refit.fleet.fanout import FanoutRouter
    from megatron_refit.plan.fanout import Placement

    plan, other = 11, 12  # replica 1's plan is its own object with replica 0's fingerprint: one plan
    router = FanoutRouter("chain", delta="on", bucket_bytes=1 << 20, replica_size=1)
    members = {0: _Member(plan), 1: _Member(plan), 2: _Member(plan), 3: _Member(other)}
    members[1].ep.plan = object()
    first = {row[0]: Placement.from_values(row[1:]) for row in router.decide(members, full=False)}
    # nothing landed yet: replicas 0..2 (one plan) chain full refits; 3 (another plan) goes direct
    assert first == {0: Placement(-1, 1, (1,), -1), 1: Placement(0, 1, (2,), -1), 2: Placement(1, 1, (), -1)}
    router.record(1, [0, 1, 2, 3], {}, {})
    members[2].ep._base = 1  # replica 2's train-side copies hold version 1: it heads the chain of deltas
    second = {row[0]: Placement.from_values(row[1:]) for row in router.decide(members, full=False)}
    assert second == {2: Placement(-1, 2, (0,), 1), 0: Placement(2, 2, (1,), 1), 1: Placement(0, 2, (), 1)}
    again = {row[0]: Placement.from_values(row[1:]) for row in router.decide(members, full=False)}
    assert again == second  # nothing changed: the same epoch, the same links
    router.record(2, [0, 1, 2, 3], {1: "failed"}, {})  # replica 1 failed: no known version; a new epoch
    members[2].ep._base = 2
    third = {row[0]: Placement.from_values(row[1:]) for row in router.decide(members, full=False)}
    assert third == {2: Placement(-1, 3, (0,), 2), 0: Placement(2, 3, (), 2)}  # replica 1: direct, in full
    router.record(3, [0, 1, 2, 3], {}, {"refit/relay_fallbacks": 1})  # a relay routed around: new epoch
    assert Placement.from_values(router.decide(members, full=False)[0][1:]).epoch == 4
