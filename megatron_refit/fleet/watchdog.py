"""Train rank 0's watch over the engine replicas' heartbeats: :class:`Watchdog` (what they are
for: :mod:`megatron_refit.group.beats`; the beat itself:
:class:`~megatron_refit.engine_side.heartbeat.Heartbeat`)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from megatron_refit.group.beats import POLLS_PER_STALL, heartbeat_key, own_store, stall_s
from megatron_refit.group.store import namespace

logger = logging.getLogger(__name__)


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
                    [f"{namespace(replica, incarnation)}/{heartbeat_key(r)}" for r in range(self.cfg.replica_size)],
                    abort,
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
                self._store = own_store(self.cfg.host, self.cfg.port, None, 10.0)
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
                why = (f"engine replica {replica} stalled: its rank {tp_rank} sent no heartbeat for {quiet:.1f} s "
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
