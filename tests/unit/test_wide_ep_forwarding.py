"""Forwarding a deployment's dense weights from its DP rank 0 (#64 item 2, as the cost model weighs
it): every gen rank still ends up with exactly the bytes it gets direct, the trainers send each
dense byte once per deployment, the experts go direct, and the relays follow a chain or tree over
the DP ranks, TP rank k to TP rank k."""

from __future__ import annotations

from collections import defaultdict

import pytest

from megatron_refit.plan.deployment_forwarding import forwarding_routes

TP, D, DEPLOYMENTS, TRAIN = 2, 3, 2, 4
SIZE = TP * D


def _routes():
    """Direct routes: each gen rank's dense shard (by its TP rank) from two train ranks, its experts
    from one (they differ per rank)."""
    dense, experts = {}, {}
    for gen in range(SIZE * DEPLOYMENTS):
        k = gen % TP
        dense[(k, gen)] = 100 + 10 * k
        dense[(2 + k, gen)] = 7
        experts[(gen % TRAIN, gen)] = 1000 + gen
    return dense, experts


@pytest.mark.parametrize("mode, depth", [("chain", D - 1), ("tree", 1)])
def test_each_rank_gets_what_it_gets_direct_and_the_trainers_send_dense_bytes_once_per_deployment(mode, depth):
    dense, experts = _routes()
    routes = forwarding_routes(dense, experts, tp=TP, attention_dp=D, deployments=DEPLOYMENTS, mode=mode)
    got: dict[int, int] = defaultdict(int)
    for (_, gen), nbytes in routes.from_trainers.items():
        got[gen] += nbytes
    for (src, dst), nbytes in routes.relays.items():
        assert src % TP == dst % TP and src // SIZE == dst // SIZE  # TP rank k to k, inside a deployment
        got[dst] += nbytes
    direct: dict[int, int] = defaultdict(int)
    for (_, gen), nbytes in dense.items():
        direct[gen] += nbytes
    for (_, gen), nbytes in experts.items():
        direct[gen] += nbytes
    assert dict(got) == dict(direct)
    dense_once = sum(nbytes for (_, gen), nbytes in dense.items() if gen % SIZE < TP)
    assert routes.bytes_from_trainers == dense_once + sum(experts.values())
    assert routes.depth == depth and routes.replicas == D
    # every DP rank but the first is fed by exactly one relay per TP rank
    fed = [dst for _, dst in routes.relays]
    assert sorted(fed) == sorted(g for g in range(SIZE * DEPLOYMENTS) if g % SIZE >= TP)


def test_dp_ranks_holding_other_dense_bytes_are_refused_by_name():
    dense, experts = _routes()
    dense[(0, 4)] += 1  # DP rank 2's TP rank 0 of deployment 0
    with pytest.raises(ValueError, match=r"gen rank 4 \(DP rank 2\) receives 108 dense bytes, DP rank 0's TP rank 0 "
                                         r"107"):
        forwarding_routes(dense, experts, tp=TP, attention_dp=D, deployments=DEPLOYMENTS, mode="chain")
    with pytest.raises(ValueError, match="forwarding mode must be one of"):
        forwarding_routes(*_routes(), tp=TP, attention_dp=D, deployments=DEPLOYMENTS, mode="off")
    with pytest.raises(ValueError, match="outside 1 deployment"):
        forwarding_routes(*_routes(), tp=TP, attention_dp=D, deployments=1, mode="tree")


def test_node_scheme_splits_each_dense_shard_over_the_dp_ranks_sharing_a_node():
    """Two DP ranks a node (gen ranks 0-3 on node 0, 4-7 on node 1, 8-11 on node 2): each of a node's
    DP ranks holding TP rank k takes half of every train route to it and passes its half to the
    other; DP rank 2 of deployment 0 is alone on its node and takes its routes whole."""
    from megatron_refit.plan.deployment_forwarding import node_routes

    dense, experts = _routes()
    node = [gen // 4 for gen in range(SIZE * DEPLOYMENTS)]
    routes = node_routes(dense, experts, tp=TP, attention_dp=D, deployments=DEPLOYMENTS, node=node)
    got: dict[int, int] = defaultdict(int)
    for (_, gen), nbytes in routes.from_trainers.items():
        got[gen] += nbytes
    for (src, dst), nbytes in routes.relays.items():
        assert node[src] == node[dst] and src % TP == dst % TP and src // SIZE == dst // SIZE
        got[dst] += nbytes
    direct: dict[int, int] = defaultdict(int)
    for (_, gen), nbytes in [*dense.items(), *experts.items()]:
        direct[gen] += nbytes
    assert dict(got) == dict(direct)
    assert routes.depth == 1 and routes.mode == "node"
    # deployment 0: DP ranks 0 and 1 (gen 0-3) share node 0, DP rank 2 (gen 4, 5) shares node 1 with
    # deployment 1's DP rank 0 (gen 6, 7), which must not relay to it
    assert (0, 2) in routes.relays and (2, 0) in routes.relays and (4, 6) not in routes.relays
    assert routes.from_trainers[(0, 4)] == dense[(0, 4)] + experts[(0, 4)]  # alone on its node: its routes whole
    assert routes.from_trainers[(0, 0)] == dense[(0, 0)] // 2 + experts[(0, 0)]
    assert routes.relays[(0, 2)] == dense[(0, 0)] // 2 + 4  # its half of both train routes (7: 4 + 3)
