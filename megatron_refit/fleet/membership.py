"""Fleet membership as a pure state machine (no process, no store, no thread).

A replica is *joining* while its refit group connects and prepares (in its own lane, every train
rank at once), then a *member* once every train rank finished that without an error, or it failed
to join. A member *leaves* when its engine says so (or is *dropped* when its group broke). Replicas
come and go by index; each start of an engine is an *incarnation* (a random id): a leave counts
only for the incarnation that is a member, and a restarted engine replaces its predecessor.

Train rank 0 reads the announcements and turns them into the changes every train rank applies
(:meth:`Membership.decide`); every train rank shows how its joins went, and all decide alike from
what they all showed (:func:`resolve`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

DONE, PENDING = "done", "pending"
"""A join's status on one train rank; a failed one shows ``"failed: <why>"``."""


def join_status(future) -> str:
    """How a join went on this rank (``future``: the join's): :data:`DONE`, :data:`PENDING` or
    ``"failed: <why>"``."""
    if not future.done():
        return PENDING
    exc = future.exception()
    return DONE if exc is None else f"failed: {type(exc).__name__}: {exc}"[:1000]


@dataclass
class Changes:
    """What every train rank does at the start of a refit (decided by train rank 0)."""

    joins: list[tuple[int, str]] = field(default_factory=list)
    """``(replica, incarnation)`` to start joining (replacing a member or a join of that index)."""
    leaves: list[int] = field(default_factory=list)
    """Members that left."""

    def as_wire(self) -> list:
        return [[list(j) for j in self.joins], list(self.leaves)]

    @classmethod
    def from_wire(cls, wire: list) -> Changes:
        return cls(joins=[(int(r), str(who)) for r, who in wire[0]], leaves=[int(r) for r in wire[1]])


@dataclass
class Membership:
    """Train rank 0's view: each replica's incarnation, whether member or joining (``None``: a
    replica the job starts with whose engine has not announced itself yet)."""

    incarnations: dict[int, str | None] = field(default_factory=dict)
    gone: set[tuple[int, str]] = field(default_factory=set)
    """Incarnations that failed to join or broke: never joined again (only a new one of that replica)."""

    def starting(self, replicas) -> None:
        """The replicas the job starts with: joining, their incarnations still unknown."""
        for replica in replicas:
            self.incarnations.setdefault(replica, None)

    def bound(self, replica: int, incarnation: str) -> None:
        """A starting replica's join found its engine's incarnation."""
        if self.incarnations.get(replica, "") is None:
            self.incarnations[replica] = incarnation

    def decide(self, joins: list[tuple[int, str]], leaves: list[tuple[int, str]]) -> Changes:
        """The changes of the announcements read since the last refit (in order): the latest
        incarnation of each replica joins, unless it is the one held or one its starting join
        reads itself; a leave counts for the held incarnation only, and not where the replica
        rejoined in the same batch."""
        latest: dict[int, str] = {}
        for replica, incarnation in joins:
            latest[replica] = incarnation
        out = Changes()
        for replica, incarnation in sorted(latest.items()):
            held = self.incarnations.get(replica, "")
            if held is None or held == incarnation or (replica, incarnation) in self.gone:
                continue  # a starting join reads its own; a repeat; one that failed already
            self.incarnations[replica] = incarnation
            out.joins.append((replica, incarnation))
        for replica, incarnation in leaves:
            if replica in latest and latest[replica] != incarnation:
                continue
            if self.incarnations.get(replica) == incarnation and replica not in out.leaves:
                out.leaves.append(replica)
                del self.incarnations[replica]
        out.leaves.sort()
        return out

    def forget(self, replica: int) -> None:
        """The replica failed to join or its group broke: a new incarnation's announcement starts
        it again (its announcement of the one that failed, read later, does not)."""
        incarnation = self.incarnations.pop(replica, None)
        if incarnation is not None:
            self.gone.add((replica, incarnation))


def resolve(statuses: list[dict[int, str]], joining) -> tuple[list[int], dict[int, str], list[int]]:
    """From every train rank's statuses of its joins (``statuses[rank][replica]``): the replicas
    that joined (done on every rank), those that failed (on some rank: its reason; the first
    rank's), and those still pending somewhere. Every train rank decides alike."""
    joined, failed, pending = [], {}, []
    for replica in sorted(joining):
        seen = [s.get(replica, PENDING) for s in statuses]
        why = next((s for s in seen if s not in (DONE, PENDING)), None)
        if why is not None:
            failed[replica] = why.removeprefix("failed: ")
        elif all(s == DONE for s in seen):
            joined.append(replica)
        else:
            pending.append(replica)
    return joined, failed, pending
