"""Stall detection (megatron_refit.fleet.heartbeat): counters, not clocks; one quiet TP rank is a stall."""

from __future__ import annotations

import pytest

from megatron_refit.config import RefitConfig
from megatron_refit.fleet.heartbeat import Heartbeat, Watchdog, stall_s


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _watchdog(gen_tp=2, stall=2.0, timeout=30.0):
    clock = _Clock()
    cfg = RefitConfig(enabled=True, gen_tp=gen_tp, stall_s=stall, timeout_s=timeout)
    return Watchdog(cfg, clock=clock), clock


def test_a_replica_whose_counters_move_is_never_stalled_however_slow_its_refit():
    dog, clock = _watchdog()
    aborted = []
    dog.watch(1, "inc", aborted.append)
    counts = {"n": 0}

    def read(keys):
        counts["n"] += 1
        return [counts["n"]] * len(keys)

    for _ in range(20):  # 20 s of a slow refit, beats going on
        clock.now += 1.0
        assert dog.check(read) == []
    assert aborted == []


def test_one_quiet_tp_rank_stalls_its_replica_after_stall_s_and_its_group_is_aborted_once():
    dog, clock = _watchdog()
    aborted = []
    dog.watch(1, "inc", aborted.append)
    dog.watch(0, "other", lambda why: aborted.append(("replica 0", why)))
    beats = {"n": 0}

    def read(keys):
        beats["n"] += 1
        if "replica/1/" in keys[0]:
            return [beats["n"], 7]  # TP rank 1 stopped at 7 beats
        return [beats["n"], beats["n"]]

    clock.now += 0.5
    assert dog.check(read) == []
    assert keys_of(dog) == {(0, "other"), (1, "inc")}
    clock.now += 1.9
    assert dog.check(read) == []  # quiet 1.9 s: not yet
    clock.now += 0.2
    assert dog.check(read) == [1]
    assert aborted == ["engine replica 1 stalled: its TP rank 1 sent no heartbeat for 2.1 s (refit.stall_s=2)"]
    clock.now += 5
    assert dog.check(read) == []  # aborted once; replica 0 goes on
    assert keys_of(dog) == {(0, "other")}


def keys_of(dog):
    return set(dog._watched)


def test_unwatch_and_abort_all():
    dog, _ = _watchdog()
    aborted = []
    dog.watch(0, "a", lambda why: aborted.append((0, why)))
    dog.watch(1, "b", lambda why: aborted.append((1, why)))
    dog.unwatch(0)
    dog.abort_all("exiting")
    assert aborted == [(1, "exiting")] and keys_of(dog) == set()


@pytest.mark.parametrize("stall,timeout,want", [(2.0, 30.0, 2.0), (0.0, 30.0, 0.0), (30.0, 30.0, 0.0),
                                                (60.0, 30.0, 0.0)])
def test_the_bound_in_force_is_off_where_it_is_zero_or_the_timeout_comes_first(stall, timeout, want):
    cfg = RefitConfig(enabled=True, stall_s=stall, timeout_s=timeout)
    assert stall_s(cfg) == want
    dog = Watchdog(cfg)
    assert dog.enabled is bool(want)
    if not want:
        dog.watch(0, "a", lambda why: pytest.fail("a disabled watchdog aborts nothing"))
        assert dog.check(lambda keys: [0] * len(keys)) == []
        beat = Heartbeat(cfg, 0, "a", 0)  # off: no thread, no store connection
        assert beat._thread is None
        beat.close()


def test_stall_s_is_checked_naming_the_bad_value():
    with pytest.raises(ValueError, match=r"refit.stall_s must be 0 \(off\) or positive, got -1"):
        RefitConfig(stall_s=-1)
