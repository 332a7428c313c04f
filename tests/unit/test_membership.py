"""Fleet membership as a pure state machine (megatron_refit.fleet.membership): no process, no store."""

from __future__ import annotations

from megatron_refit.fleet.membership import DONE, PENDING, Changes, Membership, resolve


def test_starting_replicas_read_their_own_announcements_and_are_not_joined_twice():
    m = Membership()
    m.starting([0, 1])
    # replica 0's starting join found its incarnation; replica 1's has not yet
    m.bound(0, "a0")
    changes = m.decide([(0, "a0"), (1, "b0")], [])
    assert changes == Changes()  # both are the starting joins' own: nothing to start again
    m.bound(1, "b0")
    assert m.decide([(1, "b0")], []) == Changes()  # a repeat


def test_a_new_incarnation_replaces_the_member_and_a_leave_counts_only_for_the_one_held():
    m = Membership({0: "a0", 1: "b0"})
    assert m.decide([(1, "b1")], [(1, "b0")]) == Changes(joins=[(1, "b1")], leaves=[])  # restarted: the old
    # incarnation's late leave does not drop the new one
    assert m.incarnations == {0: "a0", 1: "b1"}
    assert m.decide([], [(1, "b0")]) == Changes()
    assert m.decide([], [(1, "b1"), (0, "a0")]) == Changes(joins=[], leaves=[0, 1])
    assert m.incarnations == {}


def test_the_latest_announcement_of_a_replica_wins_and_a_new_index_joins():
    m = Membership({0: "a0"})
    assert m.decide([(2, "c0"), (2, "c1"), (3, "d0")], []) == Changes(joins=[(2, "c1"), (3, "d0")])


def test_a_forgotten_incarnation_is_never_joined_again_from_its_old_announcement():
    """A starting replica whose join failed (it stalled in prepare): its announcement, read only
    at the first refit, must not start the same incarnation again (its group's keys are taken)."""
    m = Membership()
    m.starting([0, 1])
    m.bound(1, "b0")
    m.forget(1)
    assert m.decide([(1, "b0")], []) == Changes()
    assert m.decide([(1, "b1")], []) == Changes(joins=[(1, "b1")])  # a restart joins


def test_changes_travel_as_plain_lists():
    changes = Changes(joins=[(2, "c1")], leaves=[0])
    assert Changes.from_wire(changes.as_wire()) == changes


def test_resolve_decides_alike_from_every_rank_view():
    statuses = [{0: DONE, 1: DONE, 2: PENDING, 3: "failed: boom"},
                {0: DONE, 1: PENDING, 2: "failed: rank 1 saw it", 3: DONE}]
    joined, failed, pending = resolve(statuses, [0, 1, 2, 3])
    assert joined == [0] and pending == [1]
    assert failed == {2: "rank 1 saw it", 3: "boom"}
    assert resolve([{}, {}], [5]) == ([], {}, [5])  # not started anywhere yet

