"""Replica fan-out as a transfer graph (pure math): the train ranks send each byte once, to one
replica, and the replicas forward it.

Replicas of one layout hold the same pieces, so engine rank ``k`` of one replica can forward what
it received to engine rank ``k`` of another, bucket by bucket. :func:`fanout_routes` turns a
plan's routes to every replica (:meth:`~megatron_refit.plan.assignment.Assignment.route_bytes`:
bytes per (train rank, gen rank), gen rank ``r * tp + k`` being rank ``k`` of replica ``r``) into
the routes that remain from the train ranks (to the first replica only) and the relays between
replicas:

- ``chain``: replica 0 receives from the train ranks, replica ``r`` forwards to ``r + 1``; each
  relay sends what it receives once (its egress equals its ingress), ``R - 1`` hops deep.
- ``tree``: replica ``r`` forwards to ``2r + 1`` and ``2r + 2``; ``ceil(log2(R + 1)) - 1`` hops
  deep, but a relay with two successors sends twice what it receives.

What the cost model makes of it: :func:`megatron_refit.plan.cost.fanout_prediction`. This is
the model only; the refit itself sends to every replica directly.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

MODES = ("chain", "tree")


@dataclass(frozen=True, slots=True)
class FanoutRoutes:
    mode: str
    replicas: int
    from_trainers: dict[tuple[int, int], int]
    """Bytes per (train rank, gen rank): the first replica's routes only."""
    relays: dict[tuple[int, int], int]
    """Bytes per (gen rank, gen rank): rank ``k`` of a replica to rank ``k`` of its successor."""
    depth: int
    """Hops from the first replica to the farthest (each adds a bucket's store-and-forward)."""

    @property
    def bytes_from_trainers(self) -> int:
        return sum(self.from_trainers.values())

    @property
    def bytes_relayed(self) -> int:
        return sum(self.relays.values())


def successors(replica: int, replicas: int, mode: str) -> list[int]:
    """The replicas that ``replica`` forwards to."""
    if mode == "chain":
        return [replica + 1] if replica + 1 < replicas else []
    if mode == "tree":
        return [c for c in (2 * replica + 1, 2 * replica + 2) if c < replicas]
    raise ValueError(f"fan-out mode must be one of {list(MODES)}, got {mode!r}")


def depth(replicas: int, mode: str) -> int:
    """Hops from replica 0 to the farthest replica."""
    deepest, frontier = 0, [0]
    while True:
        frontier = [s for r in frontier for s in successors(r, replicas, mode)]
        if not frontier:
            return deepest
        deepest += 1


def fanout_routes(route_bytes: dict[tuple[int, int], int], *, tp: int, dp: int, mode: str) -> FanoutRoutes:
    """The routes of a refit to ``dp`` replicas of ``tp`` gen ranks each, under fan-out ``mode``
    (see the module docstring). Every replica must receive the same bytes per rank (replicas of
    one layout do); a plan where they differ is refused, naming the replica and rank."""
    if mode not in MODES:
        raise ValueError(f"fan-out mode must be one of {list(MODES)}, got {mode!r}")
    if tp < 1 or dp < 1:
        raise ValueError(f"fan-out needs tp >= 1 and dp >= 1, got tp={tp}, dp={dp}")
    received: dict[int, int] = defaultdict(int)
    for (_, gen), nbytes in route_bytes.items():
        if not 0 <= gen < tp * dp:
            raise ValueError(f"route to gen rank {gen} outside tp={tp} x dp={dp}")
        received[gen] += nbytes
    for gen in range(tp, tp * dp):
        if received[gen] != received[gen % tp]:
            raise ValueError(f"replica {gen // tp} rank {gen % tp} receives {received[gen]} bytes, replica 0 rank "
                             f"{gen % tp} {received[gen % tp]}: replicas of one layout receive the same bytes")
    head = {route: nbytes for route, nbytes in route_bytes.items() if route[1] < tp and nbytes}
    relays = {(r * tp + k, s * tp + k): received[k]
              for r in range(dp) for s in successors(r, dp, mode) for k in range(tp) if received[k]}
    return FanoutRoutes(mode=mode, replicas=dp, from_trainers=head, relays=relays, depth=depth(dp, mode))
