"""The fleet's store protocol: every key the train ranks and the engine replicas share in the
train ranks' store (hosted by train rank 0 at ``refit.host:refit.port``), and the calls that
read and write them: a replica's join and leave (:func:`announce`), a starting engine's
refusal (:func:`abort_join`), the wait for a replica a job starts with (:func:`await_announced`)
and train rank 0's reader of the announcements (:class:`Announcements`).
Each replica's refit group keeps its own keys under :func:`namespace`.
"""

from __future__ import annotations

import datetime
import json
import logging
import time

from megatron_refit.config import RefitConfig
from megatron_refit.errors import RefitTransportError

logger = logging.getLogger(__name__)

JOINS, LEAVES = "megatron_refit/fleet/join", "megatron_refit/fleet/leave"
"""Store keys of the announcements: ``replica:incarnation,`` entries, appended. An incarnation
(a random id per ``engine_refit``) tells a restarted replica from the one it replaces: a leave
counts only for the incarnation that is a member."""
ABORT = "megatron_refit/fleet/abort"
"""Store keys ``ABORT/<replica>``: why a starting replica's engine will not join (:func:`abort_join`)."""
SWAP = "megatron_refit/swap"
"""Replica group keys ``SWAP/<version>/<engine rank>``: (``swap: staged``) whether that rank
prepared the version beside the live model (:func:`note_swap`, :func:`unprepared`)."""
SWAP_KEYS = ("refit/swap_unprepared",)
"""The fleet summary's swap metric, after its serving ones: the replicas whose version loaded
under the pause, not prepared beside the live model (``swap: staged``; 0 otherwise)."""


def namespace(replica: int, incarnation: str) -> str:
    """Where replica ``replica``'s group (in its incarnation ``incarnation``) keeps its keys."""
    return f"megatron_refit/replica/{replica}/{incarnation}"


def announce(cfg: RefitConfig, what: str, replica: int, incarnation: str) -> None:
    """Tell the train ranks (through the control group's store, at ``refit.host:refit.port``)
    that engine replica ``replica`` (``incarnation``: this process's id for it) joins or leaves;
    they act on it at their next refit."""
    import torch.distributed as dist

    if what not in ("join", "leave"):
        raise ValueError(f"announce: {what!r} is not 'join' or 'leave'")
    # a leave is best effort, briefly: the trainer may have finished (then nobody needs it)
    wait = cfg.timeout_s if what == "join" else min(cfg.timeout_s, 2.0)
    if what == "leave" and not _listening(cfg.host, cfg.port, wait):  # a new store client would retry for seconds
        logger.info("refit: replica %d's leave was not announced (the train ranks' store is gone)", replica)
        return
    try:
        store = dist.TCPStore(cfg.host, cfg.port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=wait))
        if what == "join":
            store.set(f"{JOINS}/{replica}", incarnation)  # the latest incarnation of each replica
        store.append(JOINS if what == "join" else LEAVES, f"{replica}:{incarnation},")
    except RuntimeError as exc:
        if what == "join":
            raise RefitTransportError(f"engine replica {replica}: could not reach the train ranks' store at "
                                      f"{cfg.host}:{cfg.port} to join within {wait:g} s: {exc}") from exc
        logger.info("refit: replica %d's leave was not announced (the train ranks are gone): %s", replica, exc)


def _listening(host: str, port: int, timeout_s: float) -> bool:
    """Whether anything accepts connections at ``host:port`` (refused at once when the store is gone)."""
    import socket

    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError:
        return False
    return True


def abort_join(store, replica: int, reason: str) -> None:
    """Train rank 0's control found that replica ``replica``'s engine will not join (its connect
    call failed): every train rank's join of it stops waiting for its announcement now, raising
    ``reason``, instead of after ``refit.timeout_s``."""
    store.set(f"{ABORT}/{replica}", reason[:2000])


def await_announced(store, replica: int, timeout_s: float, stop) -> str:
    """A train rank's join of a replica the job starts with: that replica's incarnation once its
    engine announced itself; ``RefitTransportError`` if it did not within ``timeout_s``, if train
    rank 0 aborted its join (:func:`abort_join`), or if ``stop`` (an event) is set (the fleet closes)."""
    key, abort = f"{JOINS}/{replica}", f"{ABORT}/{replica}"
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if store.check([abort]):
            raise RefitTransportError(f"train rank 0 aborted the join: {store.get(abort).decode(errors='replace')}")
        if stop.is_set():
            raise RefitTransportError(f"engine replica {replica}: the fleet closed before it joined")
        if time.monotonic() > deadline:
            raise RefitTransportError(f"engine replica {replica} did not join within refit.timeout_s={timeout_s:g} s "
                                      "(started? reaching refit.host:refit.port?)")
        time.sleep(0.05)
    return store.get(key).decode()


class Announcements:
    """Train rank 0's reader of the store's announcements (each read once)."""

    def __init__(self, store):
        self.store = store
        self.seen = {JOINS: 0, LEAVES: 0}

    def read(self, key: str) -> list[tuple[int, str]]:
        """The ``(replica, incarnation)`` entries appended since the last read."""
        if not self.store.check([key]):
            return []
        text = self.store.get(key).decode()
        new, self.seen[key] = text[self.seen[key]:], len(text)
        return [(int(r), who) for r, _, who in (entry.partition(":") for entry in new.split(",") if entry)]


def note_swap(store, version: int, rank: int, why: str | None) -> None:
    """Engine rank ``rank`` of a replica (``swap: staged``), once it staged ``version`` and before
    the client pauses for its swap: ``why`` it could not prepare it beside the live model (it then
    loads under the pause), or None where it did. In its replica group's store (``store``: the
    group's, None: a transport without one, nothing noted)."""
    if store is not None:
        store.set(f"{SWAP}/{version}/{rank}", json.dumps({"why": why}))


def unprepared(store, version: int, ranks: int) -> str | None:
    """Train rank 0, once ``version`` landed on a replica of ``ranks`` engine ranks: why it loaded
    under the pause (the first rank that noted so, named), None where every rank that noted
    prepared it. The notes are removed."""
    if store is None:
        return None
    why = None
    for rank in range(ranks):
        key = f"{SWAP}/{version}/{rank}"
        if store.check([key]):
            noted = json.loads(store.get(key))["why"]
            store.delete_key(key)
            if noted is not None and why is None:
                why = f"TP rank {rank}: {noted}"
    return why
