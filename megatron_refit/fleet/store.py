"""The fleet's store protocol: every key the train ranks and the engine replicas share in the
train ranks' store (hosted by train rank 0 at ``refit.host:refit.port``), and the calls that
read and write them: a replica's join and leave (:func:`announce`), the starting engines'
refusal (:func:`abort_start`), the wait for the replicas a job starts with
(:func:`wait_for_starting`) and train rank 0's reader of the announcements (:class:`Announcements`).
Each replica's refit group keeps its own keys under :func:`namespace`.
"""

from __future__ import annotations

import datetime
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
"""Store key: why the starting engines will not join (:func:`abort_start`)."""


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


def abort_start(cfg: RefitConfig, reason: str) -> None:
    """Train rank 0's control calls found that an engine will not join (its connect call
    failed): the train ranks stop waiting for the starting replicas now, each raising
    ``reason``, instead of after ``refit.timeout_s``. Best effort (the store may not be up yet:
    then the wait still ends at its timeout)."""
    import torch.distributed as dist

    try:
        store = dist.TCPStore(cfg.host, cfg.port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=min(cfg.timeout_s, 5.0)))
        store.set(ABORT, reason[:2000])
    except RuntimeError as exc:
        logger.warning("refit: could not tell the train ranks that an engine will not join: %s", exc)


def wait_for_starting(store, cfg: RefitConfig) -> dict:
    """Train rank 0: the starting replicas' incarnations, or ``{"error": why}`` (one did not
    join within ``refit.timeout_s``, or :func:`abort_start` said it will not)."""
    keys = [f"{JOINS}/{r}" for r in range(cfg.gen_dp)]
    deadline = time.monotonic() + cfg.timeout_s
    while not store.check(keys):
        if store.check([ABORT]):
            return {"error": store.get(ABORT).decode(errors="replace")}
        if time.monotonic() > deadline:
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
            return {"error": f"engine replica(s) {missing} of refit.gen_dp={cfg.gen_dp} did not join within "
                             f"refit.timeout_s={cfg.timeout_s:g} s (started? reaching {cfg.host}:{cfg.port}?)"}
        time.sleep(0.05)
    return {r: store.get(key).decode() for r, key in enumerate(keys)}


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
