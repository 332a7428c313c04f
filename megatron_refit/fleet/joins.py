"""How engine replicas join a fleet on one train rank: :class:`Joins`, the fleet's.

A replica's join runs in its own refit lane (``replica-<r>``) of the fleet's runner: wait for its
engine's announcement (a starting replica), open its refit group (this rank's end) and prepare the
plan with its engine ranks. The train ranks take a replica in only once every one of them finished
its join (:func:`~megatron_refit.fleet.membership.resolve`); train rank 0 decides, from the
announcements in the train ranks' store, which replicas join and leave at the start of a refit
(:class:`~megatron_refit.fleet.membership.Membership`), and every train rank applies the same
changes. The fleet owns the members; this class owns the joins under way and train rank 0's
reading of the announcements, and returns what happened: the members that joined, the failures.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from megatron_refit.config import RefitConfig
from megatron_refit.errors import EngineLoadError
from megatron_refit.fleet.membership import Changes, Membership, join_status, resolve
from megatron_refit.fleet.runner import Runner
from megatron_refit.fleet.watchdog import Watchdog
from megatron_refit.group.member import close_quietly
from megatron_refit.group.store import JOINS, LEAVES, Announcements, abort_join, await_announced

JOIN_POLL_S = 0.05
"""How often the train ranks compare how their joins went, while one is still under way."""

ANNOUNCE_POLL_S = 0.02
"""How often :meth:`Joins.await_announcement` reads the store."""


class Joins:
    """The joins of one fleet on one train rank (see the module docstring). ``connect(replica,
    incarnation)`` opens that replica's group (this rank's end); ``member(group)`` builds its
    prepared :class:`~megatron_refit.fleet.member.TrainerMember`; ``closing``: set when the fleet
    closes (a join waiting for an announcement stops)."""

    def __init__(self, cfg: RefitConfig, control_group, runner: Runner, watchdog: Watchdog,
                 closing: threading.Event, *, connect: Callable, member: Callable):
        self.cfg, self.control_group, self.runner, self.watchdog = cfg, control_group, runner, watchdog
        self._closing = closing
        self._connect, self._member = connect, member
        self._joining: dict[int, Future] = {}
        self._lock = threading.Lock()
        """Train rank 0's :class:`Membership`: read by the starting replicas' joins too, in their lanes."""
        leader = control_group.rank == 0
        self.membership = Membership() if leader else None
        """Train rank 0: the incarnations it decides membership from."""
        self._announcements = Announcements(control_group.store) if leader else None
        if self.membership is not None:
            self.membership.starting(range(cfg.gen_dp))

    def start(self, replica: int, incarnation: str | None = None) -> None:
        """Replica ``replica``'s join, in its lane (``incarnation`` None: a starting replica,
        whose announcement the join waits for)."""
        self._joining[replica] = self.runner.submit(f"replica-{replica}", self._join, replica, incarnation)

    def _join(self, replica: int, incarnation: str | None):
        if incarnation is None:
            incarnation = await_announced(self.control_group.store, replica, self.cfg.timeout_s, self._closing)
            if self.membership is not None:
                with self._lock:
                    self.membership.bound(replica, incarnation)
        group = self._connect(replica, incarnation)
        self.watchdog.watch(replica, incarnation, group.abort)  # a stall in prepare ends it too
        try:
            return self._member(group)
        except BaseException:
            self.watchdog.unwatch(replica)
            group.close()
            raise

    def resolve(self) -> tuple[dict, dict[int, str]]:
        """Every train rank (collective over the control group): wait for the joins under way;
        returns the members every train rank completed (by replica) and the failed ones' reasons
        (their lanes retired, their groups closed)."""
        joined: dict = {}
        failures: dict[int, str] = {}
        while self._joining:
            mine = {r: join_status(f) for r, f in self._joining.items()}
            done, failed, pending = resolve(self.control_group.all_gather_object(mine, "fleet"), self._joining)
            for replica in done:
                joined[replica] = self._joining.pop(replica).result()
            for replica, why in failed.items():
                future = self._joining.pop(replica)
                self.watchdog.unwatch(replica)
                if future.done() and future.exception() is None:  # done here, not on another rank
                    close_quietly(future.result(), replica)
                self.runner.retire(f"replica-{replica}")
                self.forget(replica)
                failures[replica] = f"joining failed: {why}"[:1000]
            if not pending:
                break
            time.sleep(JOIN_POLL_S)
        return joined, failures

    def changes(self) -> Changes:
        """Every train rank (collective), at the start of a refit: the joins and leaves train rank
        0 decided from the announcements."""
        news = None
        if self._announcements is not None:  # rank 0 decides; the others follow
            with self._lock:
                news = self.membership.decide(self._announcements.read(JOINS),
                                              self._announcements.read(LEAVES)).as_wire()
        return Changes.from_wire(self.control_group.all_gather_object(news, "fleet")[0])

    def forget(self, replica: int) -> None:
        """Train rank 0: replica ``replica`` failed to join or its group broke; a new announcement starts it again."""
        if self.membership is not None:
            with self._lock:
                self.membership.forget(replica)

    def abort(self, replica: int, reason: str) -> None:
        """Train rank 0: replica ``replica``'s engine will not join (``reason``): every train rank's
        join of it stops waiting now."""
        abort_join(self.control_group.store, replica, reason)

    def announced(self, replica: int) -> str | None:
        """Train rank 0: the latest incarnation replica ``replica`` announced joining with
        (``None``: none yet)."""
        key = f"{JOINS}/{replica}"
        return self.control_group.store.get(key).decode() if self.control_group.store.check([key]) else None

    def await_announcement(self, replica: int, before: str | None, connecting: Future | None, engine: str) -> None:
        """Train rank 0, a replica added while the trainer runs: returns once ``replica``
        announced an incarnation other than ``before`` (the train ranks take it in at their next
        refit); raises where its connect call (``connecting``) ended first, or after
        ``refit.timeout_s``."""
        deadline = time.monotonic() + self.cfg.timeout_s
        while self.announced(replica) == before:
            if connecting is not None and connecting.done():  # it ended before it announced: nothing takes it in
                connecting.result()
                raise RuntimeError(f"{engine} replica {replica}: its connect call returned before it joined")
            if time.monotonic() > deadline:
                raise EngineLoadError(f"{engine} replica {replica} did not announce its join within "
                                      f"refit.timeout_s={self.cfg.timeout_s:g} s")
            time.sleep(ANNOUNCE_POLL_S)
