"""Every way a training process ends, ended within a stated bound: real processes, real signals.

Two train ranks and two engine replicas of the toy fleet (:mod:`megatron_refit.testing.toy_fleet`),
each in its own process (``python -m megatron_refit.testing.toy_fleet``, forked from a zygote
that imported torch once: :mod:`megatron_refit.testing.zygote`; it exits as ``python -m`` does,
through the interpreter's own finalization), refit a new version every step, under
``refit.overlap: on`` (a refit is in flight when the signal comes) unless said otherwise. Then
the operator's Ctrl-C (SIGINT to every train rank, as torchrun forwards it), a SIGTERM, or the
kill of one train rank; with or without a replica stopped (SIGSTOP) before. The bounds:

- the train ranks exit within :data:`TRAIN_EXIT_S` of the signal, never by SIGABRT
  ("terminate called without an active exception": a thread returning from a transport wait
  while the interpreter finalizes);
- every healthy engine reports the trainer gone (a named error, its state) and closes within
  :data:`ENGINE_EXIT_S`, holding the last version it landed bit for bit, or saying ``stale``.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from megatron_refit.local.launch import free_port
from megatron_refit.testing.zygote import Zygote, tail

ROOT = Path(__file__).resolve().parents[2]
TRAIN_EXIT_S = 10.0
"""Measured 0.4-1.3 s on a 2-core Xeon; the bound leaves room for ``make test``, which runs
this suite beside another on the same 2 cores."""
ENGINE_EXIT_S = 15.0
TIMEOUT_S = 60.0
"""``refit.timeout_s``: every bound above is far below it (nothing waits one out)."""


class _Rank:
    """One rank of the toy fleet, ``python -m megatron_refit.testing.toy_fleet ROLE RANK PORT``
    forked from the module's zygote (:mod:`megatron_refit.testing.zygote`: torch imported once);
    its JSON events read from its standard output as it writes them."""

    def __init__(self, zygote: Zygote, role: str, rank: int, port: int, env: dict, logs: Path):
        self.events: list[dict] = []
        self._out, self._err = logs / f"{role}{rank}.out", logs / f"{role}{rank}.err"
        self.proc = zygote.start("megatron_refit.testing.toy_fleet", [role, str(rank), str(port)], env,
                                 self._out, self._err)
        self._stop = threading.Event()
        threading.Thread(target=tail, args=(self._out, self._stop, self._event), daemon=True).start()

    def _event(self, line: str) -> None:
        if line.startswith("{"):
            self.events.append(json.loads(line))

    @property
    def stderr(self) -> str:
        return self._err.read_text(errors="replace") if self._err.exists() else ""

    def seen(self, event: str) -> list[dict]:
        return [e for e in self.events if e["event"] == event]

    def exit_within(self, seconds: float) -> int | None:
        try:
            code = self.proc.wait(seconds)
        except TimeoutError:
            return None
        self._stop.set()
        time.sleep(0.1)  # the tail reads what the rank wrote last
        return code

    def dump(self) -> str:
        """Every thread's stack of a rank that did not end (faulthandler on SIGUSR1), then its end."""
        self.proc.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        self.proc.kill()
        self.proc.wait(10)
        return self.stderr[-6000:]


@pytest.fixture(scope="module")
def zygote():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    z = Zygote(["torch", "megatron_refit.testing.toy_fleet"], env)
    yield z
    z.close()


def _fleet(zygote: Zygote, logs: Path, overlap: str = "on", stall_s: float = 0.0):
    port = free_port()
    env = {"TOY_OVERLAP": overlap, "TOY_TIMEOUT_S": str(TIMEOUT_S), "TOY_STALL_S": str(stall_s)}
    train = [_Rank(zygote, "train", r, port, env, logs) for r in range(2)]
    time.sleep(0.5)  # train rank 0 hosts the store
    engines = [_Rank(zygote, "engine", 2 + g, port, env, logs) for g in range(2)]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(train[0].seen("landed")) < 3:
        for rank in train + engines:
            assert rank.proc.poll() is None, (rank.proc.pid, rank.stderr[-3000:])
        time.sleep(0.05)
    assert len(train[0].seen("landed")) >= 3, [r.events for r in train + engines]
    return train, engines


def _end(ranks):
    for rank in ranks:
        if rank.proc.poll() is None:
            rank.proc.kill()
            rank.proc.wait(10)


def _signal_and_time(train, sig, targets=None):
    start = time.monotonic()
    for rank in targets or train:
        rank.proc.send_signal(sig)
    return start


def _check_engine_ended(engine, start):
    rc = engine.exit_within(ENGINE_EXIT_S - (time.monotonic() - start))
    assert rc == 0, (rc, engine.events, engine.stderr[-3000:])
    failed, closed = engine.seen("failed"), engine.seen("closed")
    assert failed and closed, engine.events
    assert "Refit" in failed[0]["error"], failed  # named: a transport error, not a raw library one
    # it holds the last version it landed, bit for bit, unless the trainer went mid-refit (stale: it says so)
    assert closed[0]["exact"] or failed[0]["state"] == "stale", engine.events
    assert closed[0]["close_s"] < 1.0, closed  # its leave is not retried against a store that is gone
    print(f"engine exited {time.monotonic() - start:.2f} s after the signal (close {closed[0]['close_s']:.3f} s)")


def _check_train_exited(train, start, sig):
    for rank in train:
        rc = rank.exit_within(TRAIN_EXIT_S - (time.monotonic() - start))
        assert rc is not None, ("still running", rank.events, rank.dump())
        assert rc == -sig, (rc, rank.stderr[-3000:])
        assert "terminate called" not in rank.stderr, rank.stderr[-3000:]
        print(f"train rank exited {time.monotonic() - start:.2f} s after the signal")


@pytest.mark.parametrize("sig,overlap", [(signal.SIGINT, "on"), (signal.SIGINT, "off"), (signal.SIGTERM, "on")],
                         ids=["ctrl_c-overlap_on", "ctrl_c-overlap_off", "sigterm-overlap_on"])
def test_a_signal_to_the_train_ranks_ends_every_process_within_seconds(sig, overlap, zygote, tmp_path):
    """Ctrl-C (SIGINT, as torchrun forwards it), under overlap or not, and SIGTERM."""
    train, engines = _fleet(zygote, tmp_path, overlap)
    try:
        start = _signal_and_time(train, sig)
        _check_train_exited(train, start, sig)
        for engine in engines:
            _check_engine_ended(engine, start)
    finally:
        _end(train + engines)


def test_ctrl_c_with_a_stopped_replica_ends_within_seconds_not_at_the_timeout(zygote, tmp_path):
    """Replica 1 is stopped (SIGSTOP) first: the refit in flight waits on it, yet Ctrl-C ends
    the train ranks at once (their groups aborted at exit) and the healthy engine reports it."""
    train, engines = _fleet(zygote, tmp_path, "on")
    try:
        engines[1].proc.send_signal(signal.SIGSTOP)
        time.sleep(1.0)  # a refit is now stuck on it
        start = _signal_and_time(train, signal.SIGINT)
        _check_train_exited(train, start, signal.SIGINT)
        _check_engine_ended(engines[0], start)
    finally:
        _end(train + engines)


def test_a_killed_train_rank_ends_the_others_and_the_engines_within_seconds(zygote, tmp_path):
    """Train rank 1 is killed (SIGKILL: no cleanup). Train rank 0 fails its next refit at once,
    named (its peer closed the connection), and exits; the engines report it and close."""
    train, engines = _fleet(zygote, tmp_path, "on")
    try:
        start = _signal_and_time(train, signal.SIGKILL, targets=[train[1]])
        rc = train[0].exit_within(TRAIN_EXIT_S)
        assert rc == 1, (rc, train[0].events, train[0].stderr[-3000:])
        assert "RefitTransportError" in train[0].stderr and "terminate called" not in train[0].stderr, \
            train[0].stderr[-3000:]
        for engine in engines:
            _check_engine_ended(engine, start)
    finally:
        _end(train + engines)
