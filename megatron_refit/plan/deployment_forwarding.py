"""Forwarding the dense weights inside a wide expert-parallel deployment, as the cost model weighs it (pure).

A deployment of ``D`` data-parallel ranks of ``T`` tensor-parallel ranks holds its attention (and
every other dense weight) ``D`` times: TP rank ``k`` of every DP rank holds the same shard. The
refit sends it to each of them from the train ranks (**direct**: the trainers' NICs carry it ``D``
times). The alternative is to send it to DP rank 0 only and have its TP rank ``k`` forward it to TP
rank ``k`` of the other DP ranks, in a ``chain`` or a ``tree`` over the DP ranks (the shapes of
:mod:`megatron_refit.plan.fanout`, one level down: :func:`forwarding_routes`), or, where several
DP ranks of a deployment share a node (attention TP below the node's GPUs), to split each TP
rank's dense bytes over the node's DP ranks holding it, each receiving its share from the train
ranks and passing it to the others over NVLink (``node``: :func:`node_routes`). The routed experts
go direct either way, each to the ranks whose slots hold it. The cost model predicts every scheme
and says which is fastest (:func:`megatron_refit.tools.costmodel.forwarding_json`); the refit
runs ``direct`` or ``node`` (``refit.gen_dense_forward``: :mod:`megatron_refit.plan.dense_forward`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from megatron_refit.plan.fanout import MODES, FanoutRoutes, depth, successors

FORWARDING = ("direct", *MODES, "node")
"""The schemes the cost model weighs for a deployment's dense weights (``direct``: what the refit does)."""


def _dense_received(dense: dict[tuple[int, int], int], tp: int, attention_dp: int, deployments: int) -> dict[int, int]:
    """Dense bytes into each gen rank, checked equal over a deployment's DP ranks (``ValueError`` naming the rank)."""
    if min(tp, attention_dp, deployments) < 1:
        raise ValueError(f"forwarding needs tp, attention_dp and deployments >= 1, got {tp}, {attention_dp}, "
                         f"{deployments}")
    size = tp * attention_dp
    received: dict[int, int] = defaultdict(int)
    for (_, gen), nbytes in dense.items():
        if not 0 <= gen < size * deployments:
            raise ValueError(f"route to gen rank {gen} outside {deployments} deployment(s) of {attention_dp} x {tp}")
        received[gen] += nbytes
    for gen in range(size * deployments):
        first = gen - gen % size + gen % tp  # TP rank k of DP rank 0 of its deployment
        if received[gen] != received[first]:
            raise ValueError(f"gen rank {gen} (DP rank {gen % size // tp}) receives {received[gen]} dense bytes, DP "
                             f"rank 0's TP rank {gen % tp} {received[first]}: a deployment's DP ranks hold the same "
                             "dense shards")
    return received


def node_routes(dense: dict[tuple[int, int], int], experts: dict[tuple[int, int], int], *, tp: int,
                attention_dp: int, deployments: int, node: Sequence) -> FanoutRoutes:
    """The routes when each TP rank's dense bytes are split over the DP ranks of its deployment
    that share a node (``node[gen rank]``: any key), each taking an even share of every train rank's
    route and passing it to the others (one hop); the experts direct."""
    _dense_received(dense, tp, attention_dp, deployments)  # the DP ranks' dense shards checked alike
    size = tp * attention_dp
    peers: dict[int, list[int]] = {}  # gen rank -> the ranks of its node holding its dense shard
    for base in range(0, size * deployments, size):
        for k in range(tp):
            by_node: dict[int, list[int]] = defaultdict(list)
            for d in range(attention_dp):
                by_node[node[base + d * tp + k]].append(base + d * tp + k)
            for ranks in by_node.values():
                for rank in ranks:
                    peers[rank] = ranks
    from_trainers: dict[tuple[int, int], int] = defaultdict(int)
    for route, nbytes in experts.items():
        from_trainers[route] += nbytes
    own: dict[int, int] = defaultdict(int)  # the dense bytes each rank takes from the train ranks, then passes on
    for (src, gen), nbytes in dense.items():
        share, rest = divmod(nbytes, len(peers[gen]))
        share += rest if gen == peers[gen][0] else 0
        from_trainers[src, gen] += share
        own[gen] += share
    relays = {(a, b): own[a] for a in peers for b in peers[a] if a != b and own[a]}
    return FanoutRoutes(mode="node", replicas=attention_dp, from_trainers={r: b for r, b in from_trainers.items() if b},
                        relays=relays, depth=1 if relays else 0)


def forwarding_routes(dense: dict[tuple[int, int], int], experts: dict[tuple[int, int], int], *, tp: int,
                      attention_dp: int, deployments: int, mode: str) -> FanoutRoutes:
    """The routes of a refit into ``deployments`` deployments of ``attention_dp`` x ``tp`` gen ranks
    (gen rank ``deployment * D * T + dp_rank * T + tp_rank``) when the dense weights
    (``dense[(train rank, gen rank)]``) go to DP rank 0 and are forwarded in ``mode`` over the DP
    ranks, the experts (``experts``) direct. Every DP rank's TP rank ``k`` must receive the same
    dense bytes (they hold the same shards); a plan where they differ is refused, naming the rank."""
    if mode not in MODES:
        raise ValueError(f"forwarding mode must be one of {list(MODES)}, got {mode!r}")
    received = _dense_received(dense, tp, attention_dp, deployments)
    size = tp * attention_dp
    from_trainers: dict[tuple[int, int], int] = defaultdict(int)
    for route, nbytes in experts.items():
        from_trainers[route] += nbytes
    for (src, gen), nbytes in dense.items():
        if gen % size < tp and nbytes:
            from_trainers[src, gen] += nbytes
    relays = {(base + d * tp + k, base + s * tp + k): received[base + k]
              for base in range(0, size * deployments, size) for d in range(attention_dp)
              for s in successors(d, attention_dp, mode) for k in range(tp) if received[base + k]}
    return FanoutRoutes(mode=mode, replicas=attention_dp, from_trainers={r: b for r, b in from_trainers.items() if b},
                        relays=relays, depth=depth(attention_dp, mode))
