"""An engine rank's heartbeat: :class:`Heartbeat` (what it is for, and the train ranks' watch
over it: :mod:`megatron_refit.group.beats`)."""

from __future__ import annotations

import logging
import threading
import time

from megatron_refit.group.beats import BEATS_PER_STALL, heartbeat_key, own_store, stall_s
from megatron_refit.group.store import namespace

logger = logging.getLogger(__name__)


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
        self._connect = connect or (lambda: own_store(cfg.host, cfg.port, prefix, max(self.interval_s, 1.0)))
        self._name = f"engine replica {replica} rank {tp_rank}"
        self._store = connect() if connect else own_store(cfg.host, cfg.port, prefix, min(cfg.timeout_s, 30.0))
        self._key = heartbeat_key(tp_rank)
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
