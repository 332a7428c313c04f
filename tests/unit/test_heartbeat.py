"""Stall detection (megatron_refit.group.beats): counters, not clocks; one quiet TP rank is a
stall; train rank 0 reads the heartbeats and publishes, every train rank aborts its own group."""

from __future__ import annotations

import pytest

from megatron_refit.config import RefitConfig
from megatron_refit.engine_side.heartbeat import Heartbeat
from megatron_refit.fleet.watchdog import STALLED, Watchdog
from megatron_refit.group.beats import stall_s


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class _Store:
    """The train ranks' store, as the watchdogs and the beating engine ranks share it."""

    def __init__(self):
        self.values: dict[str, bytes] = {}
        self.reads = 0

    def add(self, key, n):
        self.reads += 1
        value = int(self.values.get(key, b"0")) + n
        self.values[key] = str(value).encode()
        return value

    def append(self, key, text):
        self.values[key] = self.values.get(key, b"") + text.encode()

    def check(self, keys):
        self.reads += 1
        return all(k in self.values for k in keys)

    def get(self, key):
        return self.values[key]

    def beat(self, replica, incarnation, tp_rank):
        self.add(f"megatron_refit/replica/{replica}/{incarnation}/heartbeat/{tp_rank}", 1)


def _watchdogs(store, clock, ranks=2, gen_tp=2, stall=2.0, timeout=30.0):
    cfg = RefitConfig(enabled=True, gen_tp=gen_tp, stall_s=stall, timeout_s=timeout)
    return [Watchdog(cfg, leader=rank == 0, store=store, clock=clock) for rank in range(ranks)]


def test_a_replica_whose_counters_move_is_never_stalled_however_slow_its_refit():
    store, clock = _Store(), _Clock()
    dogs = _watchdogs(store, clock)
    aborted = []
    for dog in dogs:
        dog.watch(1, "inc", aborted.append)
    for _ in range(20):  # 20 s of a slow refit, beats going on
        clock.now += 1.0
        store.beat(1, "inc", 0)
        store.beat(1, "inc", 1)
        assert [dog.check() for dog in dogs] == [[], []]
    assert aborted == []


def test_one_quiet_tp_rank_stalls_its_replica_and_every_train_rank_aborts_its_group_once():
    store, clock = _Store(), _Clock()
    dogs = _watchdogs(store, clock)
    aborted = {0: [], 1: []}
    for rank, dog in enumerate(dogs):
        dog.watch(1, "inc", aborted[rank].append)
        dog.watch(0, "other", lambda why, rank=rank: aborted[rank].append(("replica 0", why)))

    def poll(seconds):
        clock.now += seconds
        store.beat(0, "other", 0)
        store.beat(0, "other", 1)
        store.beat(1, "inc", 0)  # replica 1's TP rank 1 stopped beating
        return [dog.check() for dog in dogs]

    assert poll(0.5) == [[], []]
    assert poll(1.9) == [[], []]  # quiet 1.9 s: not yet
    assert poll(0.2) == [[1], [1]]  # rank 0 published, both aborted (rank 1 read it in the same poll)
    why = "engine replica 1 stalled: its rank 1 sent no heartbeat for 2.1 s (refit.stall_s=2)"
    assert aborted == {0: [why], 1: [why]}
    assert store.values[STALLED].decode() == f"1:inc:{why}\n"
    assert poll(5) == [[], []]  # once; replica 0 goes on
    late = []
    dogs[1].watch(1, "inc", late.append)  # a group to it that came up after the stall was found
    assert late == [why]
    dogs[1].watch(1, "restarted", late.append)  # a new incarnation is watched afresh
    assert late == [why]


def test_only_train_rank_0_reads_the_heartbeats():
    store, clock = _Store(), _Clock()
    leader, follower = _watchdogs(store, clock)
    for replica in range(8):
        follower.watch(replica, "i", lambda why: None)
    follower.check()
    assert store.reads == 1  # one read of the published stalls, however many replicas
    leader.watch(0, "i", lambda why: None)
    leader.check()
    assert store.reads == 1 + 2 + 1  # its replica's two TP ranks, and the published stalls


def test_unwatch_and_abort_all():
    dog, _ = _watchdogs(_Store(), _Clock())
    aborted = []
    dog.watch(0, "a", lambda why: aborted.append((0, why)))
    dog.watch(1, "b", lambda why: aborted.append((1, why)))
    dog.unwatch(0)
    dog.abort_all("exiting")
    assert aborted == [(1, "exiting")] and not dog._watched


@pytest.mark.parametrize("stall,timeout,want", [(2.0, 30.0, 2.0), (0.0, 30.0, 0.0), (30.0, 30.0, 0.0),
                                                (60.0, 30.0, 0.0)])
def test_the_bound_in_force_is_off_where_it_is_zero_or_the_timeout_comes_first(stall, timeout, want):
    cfg = RefitConfig(enabled=True, stall_s=stall, timeout_s=timeout)
    assert stall_s(cfg) == want
    store = _Store()
    dog = Watchdog(cfg, leader=True, store=store)
    assert dog.enabled is bool(want)
    if not want:
        dog.watch(0, "a", lambda why: pytest.fail("a disabled watchdog aborts nothing"))
        assert dog.check() == [] and store.reads == 0
        beat = Heartbeat(cfg, 0, "a", 0)  # off: no thread, no store connection
        assert beat._thread is None
        beat.close()


def test_stall_s_is_checked_naming_the_bad_value():
    with pytest.raises(ValueError, match=r"refit.stall_s must be 0 \(off\) or positive, got -1"):
        RefitConfig(stall_s=-1)


class _Flaky(_Store):
    """A store connection whose next ``add`` calls raise (a reset, a timeout), then work again."""

    def __init__(self, shared: _Store, failures: int):
        self.shared, self.failures = shared, failures

    def add(self, key, n):
        if self.failures:
            self.failures -= 1
            raise RuntimeError("Connection reset by peer")
        return self.shared.add(key, n)


def test_a_beat_survives_a_store_error_on_a_new_connection_and_logs_one_warning(caplog):
    import time

    shared, connections, prefix = _Store(), [], "megatron_refit/replica/0/a/"

    def connect():
        connections.append(_Flaky(shared, failures=0))
        return _Prefixed(connections[-1], prefix)

    cfg = RefitConfig(enabled=True, stall_s=0.3, timeout_s=30.0)
    beat = Heartbeat(cfg, 0, "a", 1, connect=connect)
    connections[0].failures = 1  # its first add went through (the counter exists): the next beat raises
    key = prefix + "heartbeat/1"
    with caplog.at_level("INFO", logger="megatron_refit"):
        deadline = time.monotonic() + 5.0  # 0.05 s a beat: 4 beats in 0.2 s when it lives on
        while int(shared.values.get(key, b"0")) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        beat.close()
    assert beat.errors == 1 and len(connections) == 2  # one error, then a new connection beats on
    assert int(shared.values[key]) >= 4
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "heartbeat of engine replica 0 rank 1 failed" in warnings[0].getMessage()
    assert any("back after" in r.getMessage() for r in caplog.records)


class _Prefixed:
    def __init__(self, store, prefix):
        self.store, self.prefix = store, prefix

    def add(self, key, n):
        return self.store.add(self.prefix + key, n)


def test_watchdog_store_errors_are_a_warning_once_and_it_reads_on(caplog):
    store = _Store()
    flaky = _Flaky(store, failures=0)
    flaky.check = lambda keys: (_ for _ in ()).throw(RuntimeError("store timeout")) if flaky.failures else \
        store.check(keys)
    dog = Watchdog(RefitConfig(enabled=True, gen_tp=1, stall_s=2.0, timeout_s=30.0), leader=False, store=flaky)
    dog.watch(0, "a", lambda why: None)
    flaky.failures = 3
    with caplog.at_level("INFO", logger="megatron_refit"):
        for _ in range(3):
            assert dog.check() == []
        flaky.failures = 0
        assert dog.check() == []
    assert [r.levelname for r in caplog.records] == ["WARNING", "INFO"]
    assert "heartbeats unreadable" in caplog.records[0].getMessage()
