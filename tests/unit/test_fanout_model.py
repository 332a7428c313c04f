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
