"""The fleet's runner (megatron_refit.fleet.runner): named lanes, in order, retired, joined."""

from __future__ import annotations

import threading
import time

import pytest

from megatron_refit.fleet.runner import PREFIX, Runner, running_threads


def test_a_lane_runs_its_calls_in_order_on_one_named_daemon_thread():
    runner = Runner()
    seen = []
    futures = [runner.submit("replica-0", lambda i=i: seen.append((i, threading.current_thread().name))) for i in
               range(5)]
    for f in futures:
        f.result(5)
    assert [i for i, _ in seen] == list(range(5))
    assert {name for _, name in seen} == {PREFIX + "replica-0"}
    assert running_threads() == [PREFIX + "replica-0"]
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith(PREFIX))
    assert runner.close() == []
    assert running_threads() == []


def test_lanes_run_apart_and_an_error_stays_in_its_future():
    runner = Runner()
    gate = threading.Event()
    slow = runner.submit("a", gate.wait, 5)
    fast = runner.submit("b", lambda: 7)
    assert fast.result(5) == 7 and not slow.done()  # lane b does not wait behind lane a
    gate.set()
    assert slow.result(5) is True
    bad = runner.submit("a", lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        bad.result(5)
    assert runner.submit("a", lambda: "still there").result(5) == "still there"
    runner.close()


def test_retire_cancels_what_is_queued_and_does_not_wait_for_a_stuck_call():
    runner = Runner()
    stuck, started = threading.Event(), threading.Event()
    running = runner.submit("replica-1", lambda: (started.set(), stuck.wait(10))[1])
    queued = runner.submit("replica-1", lambda: "never")
    assert started.wait(5)
    start = time.monotonic()
    runner.retire("replica-1")  # a replica dropped: its engine may hang
    assert time.monotonic() - start < 0.5
    assert queued.cancelled() and not running.done()
    assert "replica-1" not in runner.names()
    fresh = runner.submit("replica-1", lambda: "new lane")  # a rejoined replica gets a new lane
    assert fresh.result(5) == "new lane"
    stuck.set()
    assert running.result(5) is True
    runner.close()


def test_close_joins_every_lane_within_its_bound_and_names_those_still_in_a_call():
    runner = Runner()
    stuck, started = threading.Event(), threading.Event()
    runner.submit("watchdog", lambda: (started.set(), stuck.wait(10)))
    runner.submit("replica-0", lambda: None).result(5)
    assert started.wait(5)
    start = time.monotonic()
    assert runner.close(wait_s=0.3) == ["watchdog"]
    assert time.monotonic() - start < 1.0
    stuck.set()
    deadline = time.monotonic() + 5
    while running_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert running_threads() == []
    with pytest.raises(RuntimeError, match="the fleet is closed; no lane 'replica-0' starts"):
        runner.submit("replica-0", lambda: None)
