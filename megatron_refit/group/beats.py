"""A stalled engine replica told from a slow one: heartbeats in the train ranks' store.

Every engine rank beats (:class:`~megatron_refit.engine_side.heartbeat.Heartbeat`): a thread of its
own adds 1 to its counter, ``heartbeat/<tp rank>`` under its replica's namespace
(:func:`~megatron_refit.group.store.namespace`), every ``refit.stall_s / 6`` seconds, over a store
connection of its own (never queued behind the engine's own waits on the store), from before it
joins until it closes. A process that is stopped, or whose interpreter no longer runs (a deadlock
holding the GIL, a SIGSTOP, a swap storm), stops beating; one that is merely slow (a long post-load
step, a big bucket) goes on. A replica is stalled when any one of its engine ranks is (the others
wait on it).

Train rank 0 watches the replicas' counters (:class:`~megatron_refit.fleet.watchdog.Watchdog`,
polled in the fleet's runner): a replica one of whose counters did not move for ``refit.stall_s`` is
stalled; train rank 0 publishes it in the store and every train rank, reading that one key per poll,
aborts its group to it (:meth:`~megatron_refit.transport.base.Transport.abort`), so the wait on it
ends now instead of at ``refit.timeout_s``: the replica fails (its group broke), is dropped, and may
rejoin. The bound this keeps: a stalled replica holds a train rank at most ``refit.stall_s`` plus
two polls (train rank 0's, then its own: ``stall_s / 2`` in all). ``refit.stall_s: 0`` turns it off
(then ``refit.timeout_s`` is the bound). Counters, not clocks: no two hosts' clocks are compared.
"""

from __future__ import annotations

import datetime

BEATS_PER_STALL = 6
"""Beats an engine rank sends per ``refit.stall_s``: a stall is several missed beats, never one late one."""
POLLS_PER_STALL = 4
"""Times a train rank reads the counters per ``refit.stall_s``."""


def stall_s(cfg) -> float:
    """The stall bound in force: ``refit.stall_s``, or 0 (off) where ``refit.timeout_s`` comes first."""
    return cfg.stall_s if 0 < cfg.stall_s < cfg.timeout_s else 0.0


def heartbeat_key(tp_rank: int) -> str:
    return f"heartbeat/{tp_rank}"


def own_store(host: str, port: int, prefix: str | None, timeout_s: float):
    """A store connection of its own (under ``prefix``, if any)."""
    import torch.distributed as dist

    store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    return store if prefix is None else dist.PrefixStore(prefix, store)
