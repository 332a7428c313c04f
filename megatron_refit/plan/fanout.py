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

What the cost model makes of it: :func:`megatron_refit.plan.cost.fanout_prediction`. The refit
itself (``refit.fanout``) places replicas with :func:`relay_placements` and picks ``auto``'s mode with
:func:`auto_mode`; the relays run in :mod:`megatron_refit.endpoint.relay`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

MODES = ("chain", "tree")

PLACEMENT_VALUES = 6
"""Ints a :class:`Placement` takes in the version handshake."""


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one replica's refit comes from and goes to (the train ranks decide it per refit and
    show it in the replica's version handshake)."""

    upstream: int = -1
    """The replica whose engine ranks forward this one its bytes; -1: the train ranks send them."""
    epoch: int = 0
    """The train ranks' count of placement changes: the relay links of one epoch are reused until it changes."""
    successors: tuple[int, ...] = ()
    """The replicas this one forwards to (at most two)."""
    chain_base: int = -1
    """The version the chain's delta payloads apply to (-1: none, full bytes only)."""

    def values(self) -> list[int]:
        succ = list(self.successors) + [-1] * (2 - len(self.successors))
        return [self.upstream, self.epoch, len(self.successors), *succ, self.chain_base]

    @classmethod
    def from_values(cls, values) -> Placement:
        upstream, epoch, count, a, b, chain_base = (int(v) for v in values[:PLACEMENT_VALUES])
        return cls(upstream, epoch, tuple([a, b][:count]), chain_base)

    @property
    def relayed(self) -> bool:
        return self.upstream >= 0


DIRECT = Placement()


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


def upstream(position: int, mode: str) -> int:
    """The position that feeds ``position`` in a chain or tree (-1: the train ranks)."""
    if position == 0:
        return -1
    if mode == "chain":
        return position - 1
    if mode == "tree":
        return (position - 1) // 2
    raise ValueError(f"fan-out mode must be one of {list(MODES)}, got {mode!r}")


def relay_placements(replicas: list[int], mode: str) -> dict[int, tuple[int, tuple[int, ...]]]:
    """Replica index -> (its upstream replica, -1 for the train ranks; the replicas it forwards
    to), for ``replicas`` in relay order (the first receives from the train ranks)."""
    if len(set(replicas)) != len(replicas):
        raise ValueError(f"relay_placements: replicas {replicas} repeat")
    out = {}
    for i, replica in enumerate(replicas):
        up = upstream(i, mode)
        out[replica] = (-1 if up < 0 else replicas[up],
                        tuple(replicas[j] for j in successors(i, len(replicas), mode)))
    return out


def auto_mode(train_bytes: int, gen_bytes: int, replicas: int, bucket_bytes: int) -> str:
    """``refit.fanout: auto``: ``off``, ``chain`` or ``tree``, whichever the cost model predicts
    fastest with every link equally fast (the train ranks' NICs and the replicas' alike, as across
    nodes): direct, the busiest train rank sends its ``train_bytes`` to each of ``replicas``;
    a chain sends them once and each engine rank forwards its ``gen_bytes`` once, plus a bucket's
    store-and-forward per hop; a tree forwards twice over half as many hops. Link speed cancels
    out: seconds in units of one link's byte time."""
    if replicas < 2:
        return "off"
    bucket = min(bucket_bytes, max(gen_bytes, 1))
    cost = {"off": replicas * train_bytes,
            "chain": max(train_bytes, gen_bytes) + depth(replicas, "chain") * bucket,
            "tree": max(train_bytes, 2 * gen_bytes) + depth(replicas, "tree") * bucket}
    return min(cost, key=lambda mode: (cost[mode], mode != "off"))


def resolve_mode(mode: str, route_bytes: dict[tuple[int, int], int], *, tp: int, dp: int, bucket_bytes: int) -> str:
    """``refit.fanout`` for a whole plan of ``dp`` replicas: ``auto`` resolved by :func:`auto_mode`
    from the busiest train rank's bytes to the first replica and the busiest engine rank's."""
    if mode in ("off", *MODES):
        return mode
    if mode != "auto":
        raise ValueError(f"refit.fanout must be one of {['off', *MODES, 'auto']}, got {mode!r}")
    train: dict[int, int] = defaultdict(int)
    gen: dict[int, int] = defaultdict(int)
    for (src, dst), nbytes in route_bytes.items():
        if dst < tp:
            train[src] += nbytes
            gen[dst] += nbytes
    return auto_mode(max(train.values(), default=0), max(gen.values(), default=0), dp, bucket_bytes)


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
