"""``refit.fanout`` on the train side: which replica each replica's refit comes from, decided by
train rank 0 before every refit and shown to every train rank (then, in each replica's version
handshake, to its engine ranks).

Replicas share a chain (or tree) only when their next refit moves the same plan (the same layout,
all pieces or adapters alike) and, under ``refit.delta``, when they hold the same version (the
one they last landed): a delta payload the head receives applies to its successors' weights
then. A replica that joined or failed holds no known version: it gets its refit from the train
ranks directly (or, with others like it, in a chain of full refits). The head is the replica whose
train-side copies hold that version (so the chain gets deltas); the others follow by index.
The placement epoch counts changes of the placements, of the members, and refits where a replica failed
or a relay was routed around: the engine ranks join new links in a new epoch, never rejoining one.
"""

from __future__ import annotations

from megatron_refit.plan.fanout import DIRECT, Placement, auto_mode, relay_placements


class FanoutRouter:
    """Every refit's placement of each replica (see the module docstring); train rank 0 decides it."""

    def __init__(self, mode: str, *, delta: str, bucket_bytes: int, replica_size: int):
        self.mode, self.delta, self.bucket_bytes, self.replica_size = mode, delta, bucket_bytes, replica_size
        self.epoch = 0
        self._signature = None
        self._trouble = False
        self._landed: dict[int, int] = {}
        """Replica -> the version it last landed (replicas that failed or joined since: absent)."""

    def decide(self, members: dict, full: bool) -> list[list[int]]:
        """Train rank 0: ``[replica, *Placement.values()]`` for every relayed or relaying replica."""
        groups: dict[tuple, list[int]] = {}
        for replica in sorted(members):
            endpoint = members[replica].endpoint(full)
            base = self._landed.get(replica) if self.delta != "off" else 0
            # the same plan, not the same object: replicas that prepared at once each built their own
            groups.setdefault((endpoint.plan_id, base), []).append(replica)
        shape = []
        for (_, base), replicas in groups.items():
            if len(replicas) < 2:
                continue
            first = members[replicas[0]].endpoint(full)
            mode = self.mode
            if mode == "auto":
                # train rank 0's share of one replica (the plan balances the train ranks) and one engine rank's
                train_bytes = sum(b.payload_bytes for b in first.plan.buckets_from(first.group.rank))
                mode = auto_mode(train_bytes, first.plan.bytes_minimal // self.replica_size, len(replicas),
                                 self.bucket_bytes)
            if mode == "off":
                continue
            head = next((r for r in replicas if base is not None and self.delta != "off"
                         and members[r].endpoint(full).delta_base() == base), replicas[0])
            order = [head] + [r for r in replicas if r != head]
            chain_base = members[head].endpoint(full).delta_base() if self.delta != "off" else -1
            for replica, (up, successors) in relay_placements(order, mode).items():
                shape.append((replica, up, successors, chain_base))
        signature = (sorted(shape), tuple((r, id(m)) for r, m in sorted(members.items())))
        if signature != self._signature or self._trouble:
            self.epoch += 1
        self._signature, self._trouble = signature, False
        return [[replica, *Placement(up, self.epoch, successors, chain_base).values()]
                for replica, up, successors, chain_base in sorted(shape)]

    def placements(self, control_group, members: dict, full: bool) -> dict[int, Placement]:
        """Every train rank (collective over the train ranks' group): this refit's placements, train
        rank 0's; every member not named gets its refit from the train ranks. ``refit.fanout:
        off``: every member's from the train ranks, without a collective (the same config on every
        train rank)."""
        if self.mode == "off":
            return dict.fromkeys(members, DIRECT)
        decided = self.decide(members, full) if control_group.rank == 0 else None
        shown = control_group.all_gather_object(decided, "fleet")[0]
        placements = {row[0]: Placement.from_values(row[1:]) for row in shown}
        return {replica: placements.get(replica, DIRECT) for replica in members}

    def record(self, version: int, replicas: list[int], failures: dict, summary: dict) -> None:
        """After a refit: what each replica holds now; a failure or a relay routed around starts a
        new epoch at the next refit."""
        for replica in replicas:
            if replica in failures:
                self._landed.pop(replica, None)
            else:
                self._landed[replica] = version
        self._trouble = bool(failures) or summary.get("refit/relay_fallbacks", 0) > 0

    def forget(self, replica: int) -> None:
        """Replica ``replica`` left or was dropped (a new incarnation holds nothing known)."""
        self._landed.pop(replica, None)
