"""Train rank 0's control lanes (megatron_refit.fleet.lanes.ReplicaLanes): a replica that failed
its serving check is held before the refit reports the failure."""

from __future__ import annotations

import logging
import threading

from megatron_refit.config import RefitConfig
from megatron_refit.fleet.lanes import ReplicaLanes


class _Client:
    def __init__(self, delay_s: float = 0.0, fail: bool = False):
        self.delay_s, self.fail, self.held = delay_s, fail, threading.Event()

    def hold(self):
        threading.Event().wait(self.delay_s)
        if self.fail:
            raise ConnectionError("server gone")
        self.held.set()


def _lanes(*clients, timeout_s: float = 5.0) -> ReplicaLanes:
    return ReplicaLanes(list(clients), RefitConfig(engine="vllm", gen_dp=len(clients), timeout_s=timeout_s))


def _lanes_ended(lanes: ReplicaLanes, wait_s: float = 5.0) -> bool:
    """The lanes' threads ended within ``wait_s`` (the control's close, no engine told)."""
    return lanes.close(tell=False, wait_s=wait_s) == []


def test_hold_returns_once_the_replica_is_held():
    slow = _Client(delay_s=0.3)
    lanes = _lanes(_Client(), slow)
    lanes.hold(1)
    assert slow.held.is_set()  # paused before the refit's failure is reported
    assert _lanes_ended(lanes)


def test_a_hold_that_fails_is_logged_and_the_failure_still_reported(caplog):
    lanes = _lanes(_Client(fail=True))
    with caplog.at_level(logging.ERROR, logger="megatron_refit.fleet.lanes"):
        lanes.hold(0)  # does not raise: the replica's own failure is what the refit reports
    assert "engine replica 0 failed its serving check and could not be held: ConnectionError: server gone" \
        in caplog.text
    assert _lanes_ended(lanes)


def test_a_hold_that_does_not_return_is_waited_for_timeout_s_at_most(caplog):
    stuck = _Client(delay_s=3.0)
    lanes = _lanes(stuck, timeout_s=0.2)
    with caplog.at_level(logging.ERROR, logger="megatron_refit.fleet.lanes"):
        lanes.hold(0)
    assert "did not return within refit.timeout_s=0.2 s" in caplog.text and not stuck.held.is_set()
    lanes.close(tell=False, wait_s=0.1)
