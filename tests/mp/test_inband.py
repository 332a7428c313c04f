"""The serving probe in band (``group/inband.py``): point-to-point between train rank 0 and the
engine ranks of one replica's group. The other train ranks take no part (they may call nothing);
an engine rank that dies before it answers ends train rank 0's wait within the group's timeout."""

from __future__ import annotations

import os
import time

import pytest

from megatron_refit.plan.probe import Probe
from megatron_refit.local.launch import run_spawned

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

TIMEOUT_S = 3.0
PROBE = Probe(((1, 2, 3), (4, 5)))


def _rank(rank, world, port, scenario):
    from megatron_refit.group.inband import exchange_in_band, verdict_in_band
    from megatron_refit.transport import ProcessGroupTransport

    num_train = 2
    group = ProcessGroupTransport.connect(host="127.0.0.1", port=port, rank=rank, world_size=world, timeout_s=TIMEOUT_S)
    group.exchange("message")  # every rank joined
    if rank == 1:  # a train rank other than 0: nothing to do, and refused if it tries
        try:
            exchange_in_band(group, num_train)
        except ValueError as exc:
            refused = str(exc)
        if scenario == "ok":
            group.exchange("message")
        return dict(refused=refused)
    if rank == 0:
        start = time.monotonic()
        try:
            answer = exchange_in_band(group, num_train, probe=PROBE)
            told = verdict_in_band(group, num_train, failed="log-probs differ")
        except Exception as exc:  # noqa: BLE001 -- the test reads what ended the wait
            return dict(error=type(exc).__name__, seconds=time.monotonic() - start)
        group.exchange("message")
        return dict(answer=answer, told=told)
    if scenario == "dies":
        os._exit(3)  # before it answers
    seen = []

    def score(sequences):
        seen.append([list(s) for s in sequences])
        return [[-0.5] * (len(s) - 1) for s in sequences]

    answer = exchange_in_band(group, num_train, score=score, stale=lambda: ["model.norm.weight"])
    verdict = verdict_in_band(group, num_train)
    group.exchange("message")
    return dict(seen=seen, answer=answer, verdict=verdict)


def test_the_probe_goes_between_train_rank_0_and_the_engine_ranks_alone():
    train0, train1, engine = run_spawned(_rank, 3, "ok", timeout_s=120)
    assert engine["seen"] == [[[1, 2, 3], [4, 5]]] and engine["verdict"] == "log-probs differ"
    assert train0["answer"] == {"served": [[-0.5, -0.5], [-0.5]], "stale": ["model.norm.weight"]}
    assert train0["told"] == "log-probs differ"
    assert train1["refused"] == "exchange_in_band on train rank 1: train rank 0 alone asks the engine ranks"


def test_an_engine_rank_that_dies_before_it_answers_ends_the_wait_within_the_timeout():
    train0, train1, _ = run_spawned(_rank, 3, "dies", timeout_s=120, may_die=frozenset({2}))
    assert train0["error"] in ("RefitTimeoutError", "RefitTransportError"), train0
    assert train0["seconds"] < TIMEOUT_S + 2.0, train0
