"""A stalled engine replica told from a slow one: heartbeats in the train ranks' store.

Every engine rank beats (:class:`Heartbeat`): a thread of its own adds 1 to its counter,
``heartbeat/<tp rank>`` under its replica's namespace (:func:`~megatron_refit.fleet.store.namespace`),
every ``refit.stall_s / 6`` seconds, over a store connection of its own (never queued behind
the engine's own waits on the store), from before it joins until it closes. A process that is
stopped, or whose interpreter no longer runs (a deadlock holding the GIL, a SIGSTOP, a swap
storm), stops beating; one that is merely slow (a long post-load step, a big bucket) goes on.
A replica is stalled when any one of its engine ranks is (the others wait on it).

Train rank 0 watches the replicas' counters (:class:`Watchdog`, polled in the fleet's runner):
a replica one of whose counters did not move for ``refit.stall_s`` is stalled; train rank 0
publishes it in the store and every train rank, reading that one key per poll, aborts its group
to it (:meth:`~megatron_refit.transport.base.Transport.abort`), so
the wait on it ends now instead of at ``refit.timeout_s``: the replica fails (its group broke),
is dropped, and may rejoin. The bound this keeps: a stalled replica holds a train rank at most
``refit.stall_s`` plus two polls (train rank 0's, then its own: ``stall_s / 2`` in all).
``refit.stall_s: 0`` turns it off (then ``refit.timeout_s`` is the bound). Counters, not clocks:
no two hosts' clocks are compared.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from dataclasses import dataclass, field

from megatron_refit.fleet.store import namespace

logger = logging.getLogger(__name__)

BEATS_PER_STALL = 6
"""Beats an engine rank sends per ``refit.stall_s``: a stall is several missed beats, never one late one."""
POLLS_PER_STALL = 4
"""Times a train rank reads the counters per ``refit.stall_s``."""


def stall_s(cfg) -> float:
    """The stall bound in force: ``refit.stall_s``, or 0 (off) where ``refit.timeout_s`` comes first."""
    return cfg.stall_s if 0 < cfg.stall_s < cfg.timeout_s else 0.0


def _key(tp_rank: int) -> str:
    return f"heartbeat/{tp_rank}"


def _store(host: str, port: int, prefix: str | None, timeout_s: float):
    """A store connection of its own (under ``prefix``, if any)."""
    import torch.distributed as dist

    store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    return store if prefix is None else dist.PrefixStore(prefix, store)


class Heartbeat:
    """An engine rank's beat (see the module docstring); started at once, stopped by :meth:`close`.
    A store error does not end it: the rank logs one WARNING, opens a new connection and beats on
    at the next interval, so an error that passes within ``stall_s`` costs no stall (an error that
    lasts is the store gone: the train ranks drop the replica, or are gone themselves)."""

    def __init__(self, cfg, replica: int, incarnation: str, tp_rank: int, *, connect=None):
        self.interval_s = stall_s(cfg) / BEATS_PER_STALL
        self._stop = threading.Event()
        self._thread = None
        self.errors = 0
        """Store errors met so far (each one retried at the next beat)."""
        if not self.interval_s:
            return
        prefix = namespace(replica, incarnation)
        # after an error, a new connection waits at most a beat for the store (close is not held up)
        self._connect = connect or (lambda: _store(cfg.host, cfg.port, prefix, max(self.interval_s, 1.0)))
        self._name = f"engine replica {replica} TP rank {tp_rank}"
        self._store = connect() if connect else _store(cfg.host, cfg.port, prefix, min(cfg.timeout_s, 30.0))
        self._key = _key(tp_rank)
        self._store.add(self._key, 1)  # the counter exists before the rank joins its group
        self._thread = threading.Thread(target=self._beat, name=f"megatron_refit-heartbeat-{replica}-{tp_rank}",
                                        daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        failing_since = None
        while not self._stop.wait(self.interval_s):
            try:
                if self._store is None:
                    self._store = self._connect()
                self._store.add(self._key, 1)
            except Exception as exc:  # noqa: BLE001 -- retried at the next beat, on a new connection
                self.errors += 1
                self._store = None
                if failing_since is None:
                    failing_since = time.monotonic()
                    logger.warning("refit: heartbeat of %s failed, retrying every %.2f s: %s", self._name,
                                   self.interval_s, exc)
                continue
            if failing_since is not None:
                logger.info("refit: heartbeat of %s back after %.2f s", self._name, time.monotonic() - failing_since)
                failing_since = None

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.interval_s + 5.0)
            self._thread = None


@dataclass
class _Watched:
    keys: list[str]
    abort: object
    """What ends this rank's waits on the replica (its group's ``abort``)."""
    since: float
    published: bool = False
    """Train rank 0 published its stall (once)."""
    counts: list[int | None] = field(default_factory=list)
    moved: list[float] = field(default_factory=list)
    """When each rank's counter last moved (this train rank's monotonic clock)."""

    def __post_init__(self):
        self.counts = [None] * len(self.keys)
        self.moved = [self.since] * len(self.keys)

    def quiet(self, counts: list[int], now: float) -> tuple[int, float]:
        """Take a reading; the engine rank quiet longest, and for how long."""
        for i, count in enumerate(counts):
            if count != self.counts[i]:
                self.counts[i], self.moved[i] = count, now
        rank = min(range(len(self.keys)), key=lambda i: self.moved[i])
        return rank, now - self.moved[rank]


STALLED = "megatron_refit/fleet/stalled"
"""Store key: ``replica:incarnation:why`` lines, appended by train rank 0 for each stall it found."""


class Watchdog:
    """A train rank's watch over its replicas (see the module docstring), and the one place that
    knows how to end its waits on each replica's group. Train rank 0 (``leader``) reads the
    heartbeats and publishes each stall it finds (:data:`STALLED`); every train rank reads that
    one key per poll and aborts its own group to the replica named, so the store serves one read
    per train rank per poll however many replicas and TP ranks there are. ``watch`` / ``unwatch``
    come from any thread; :meth:`check` from the fleet's ``watchdog`` lane. ``store``: the train
    ranks' store (default: a connection of its own, opened at the first poll)."""

    def __init__(self, cfg, *, leader: bool, store=None, clock=time.monotonic):
        self.cfg = cfg
        self.leader = leader
        self.stall_s = stall_s(cfg)
        self.poll_s = self.stall_s / POLLS_PER_STALL
        self._clock = clock
        self._watched: dict[tuple[int, str], _Watched] = {}
        self._lock = threading.Lock()
        self._store = store
        self._own_store = store is None
        self._failing = False
        """The last poll met a store error (logged once per run of them)."""
        self._seen = 0
        """How much of :data:`STALLED` this rank has read."""
        self._stalled: dict[tuple[int, str], str] = {}
        """Every stall read so far: a group this rank connects to later is aborted at once."""

    @property
    def enabled(self) -> bool:
        return bool(self.stall_s)

    def watch(self, replica: int, incarnation: str, abort) -> None:
        """Watch replica ``replica`` (``incarnation``) from now; ``abort(reason)`` ends this rank's
        waits on it (on a stall, and at :meth:`abort_all`)."""
        with self._lock:
            why = self._stalled.get((replica, incarnation))
            if why is None:
                self._watched[(replica, incarnation)] = _Watched(
                    [f"{namespace(replica, incarnation)}/{_key(tp)}" for tp in range(self.cfg.gen_tp)], abort,
                    since=self._clock())
        if why is not None:  # found stalled before this rank's group to it was up
            abort(why)

    def abort_all(self, reason: str) -> None:
        """End this rank's waits on every watched replica now (the fleet aborts)."""
        with self._lock:
            watched, self._watched = list(self._watched.values()), {}
        for entry in watched:
            entry.abort(reason)

    def unwatch(self, replica: int) -> None:
        with self._lock:
            for key in [k for k in self._watched if k[0] == replica]:
                del self._watched[key]

    def check(self) -> list[int]:
        """One poll (see the class docstring); the replicas whose group this rank aborted."""
        if not self.enabled:
            return []
        try:
            if self._store is None:
                self._store = _store(self.cfg.host, self.cfg.port, None, 10.0)
            if self.leader:
                self._find_stalls()
            found = self._abort_published()
            if self._failing:
                logger.info("refit: heartbeats readable again")
                self._failing = False
            return found
        except Exception as exc:  # noqa: BLE001 -- retried at the next poll, on a new connection
            self._store = None if self._own_store else self._store
            if not self._failing:
                logger.warning("refit: heartbeats unreadable (retried every %.2f s; stalls go unseen until then, "
                               "refit.timeout_s still bounds every wait): %s", self.poll_s, exc)
            self._failing = True
            return []

    def _find_stalls(self) -> None:
        """Train rank 0: read every watched replica's counters; publish those quiet for ``stall_s``."""
        with self._lock:
            watched = dict(self._watched)
        now = self._clock()
        for (replica, incarnation), entry in watched.items():
            tp_rank, quiet = entry.quiet([int(self._store.add(key, 0)) for key in entry.keys], now)
            if quiet >= self.stall_s and not entry.published:
                entry.published = True
                why = (f"engine replica {replica} stalled: its TP rank {tp_rank} sent no heartbeat for {quiet:.1f} s "
                       f"(refit.stall_s={self.stall_s:g})")
                self._store.append(STALLED, f"{replica}:{incarnation}:{why}\n")

    def _abort_published(self) -> list[int]:
        """Every train rank: abort its group to each replica published stalled since the last poll."""
        if not self._store.check([STALLED]):
            return []
        text = self._store.get(STALLED).decode(errors="replace")
        new, self._seen = text[self._seen:], len(text)
        found = []
        for line in filter(None, new.split("\n")):
            replica, incarnation, why = line.split(":", 2)
            with self._lock:
                self._stalled[(int(replica), incarnation)] = why
                entry = self._watched.pop((int(replica), incarnation), None)
            if entry is None:  # not (or no longer) a group of this rank
                continue
            logger.warning("refit: %s; its group on this train rank is aborted", why)
            entry.abort(why)
            found.append(int(replica))
        return found

    def run(self, stop: threading.Event) -> None:
        """Poll every ``stall_s / 4`` until ``stop`` is set (the fleet's ``watchdog`` lane)."""
        while not stop.wait(self.poll_s):
            self.check()
