"""The one failure policy (megatron_refit.fleet.policy), from every train rank's view."""

from __future__ import annotations

import pytest

from megatron_refit.errors import ReplicaFailedError
from megatron_refit.fleet.policy import check_landed, failed_replicas


class _Report:
    def __init__(self, ok):
        self.summary = {"refit/replicas_ok": ok}


def test_a_replica_failed_if_any_rank_saw_it_and_broke_if_any_saw_its_group_break():
    views = [{1: ("TP rank 0: RuntimeError: boom", False)}, {1: ("peer gone", True), 2: ("timed out", True)}]
    failures, broken = failed_replicas(views, [0, 1, 2])
    assert failures == {1: "TP rank 0: RuntimeError: boom", 2: "timed out"} and broken == [1, 2]
    assert failed_replicas([{}, {}], [0, 1]) == ({}, [])


def test_check_landed_raises_under_raise_or_when_no_replica_holds_the_version():
    check_landed(3, _Report(2), {1: "boom"}, replicas=[0, 1, 2], on_failure="continue")  # the others hold it
    with pytest.raises(ReplicaFailedError, match=r"refit 3: engine replica\(s\) \[1\] could not apply it: replica 1: "
                                                 r"boom; the other 2 replica\(s\) hold version 3"):
        check_landed(3, _Report(2), {1: "boom"}, replicas=[0, 1, 2], on_failure="raise")
    with pytest.raises(ReplicaFailedError, match="no replica holds it"):
        check_landed(3, _Report(0), {0: "x"}, replicas=[0], on_failure="continue")
    with pytest.raises(ReplicaFailedError, match="no engine replica is connected"):
        check_landed(3, _Report(0), {}, replicas=[], on_failure="continue")
    check_landed(3, _Report(3), {}, replicas=[0, 1, 2], on_failure="raise")
