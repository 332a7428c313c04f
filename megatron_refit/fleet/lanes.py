"""Train rank 0's control calls to each engine replica: one lane per replica.

An engine with a control plane (vLLM's weight-transfer calls, SGLang's update sessions) takes
calls from train rank 0 around every refit: before the bytes move (pause, ``update_weights``)
and after (``finish_weight_update`` / resume). With many replicas, one replica's trouble must
stay with it, so :class:`ReplicaLanes` gives every replica a lane: one thread that runs its
calls in order, apart from the other replicas'. It is the fleet's
:class:`~megatron_refit.fleet.replica.ReplicaHooks`: the fleet calls :meth:`ReplicaLanes.start`
in the replica's own refit thread before its bytes move and :meth:`ReplicaLanes.land` once its
group carried the refit, so a replica whose engine cannot make the version live fails alone,
named in the report like any other failed replica, and only replicas that landed the version
resume serving. A replica that failed stays paused (its weights are no complete version) until
a refit lands on it; one whose group broke is dropped with its lane, without waiting for it.

A replica that joins a running trainer (:meth:`ReplicaLanes.add`) has its connect call run
first in its new lane: it blocks until the train ranks take the replica in at their next
refit, and the refit's calls queue behind it. ``add`` returns once the replica's join is
announced, so the next refit takes it in.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from megatron_refit.fleet.serving import ServingUnavailableError
from megatron_refit.errors import EngineLoadError

logger = logging.getLogger(__name__)


class _Lane:
    """One replica's client and the thread that runs its calls in order."""

    def __init__(self, replica: int, client) -> None:
        self.client = client
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"refit-replica-{replica}")
        self.pending: Future | None = None
        """The call whose outcome :meth:`ReplicaLanes.land` waits for (the receiving one)."""

    def submit(self, call: Callable[[Any], Any]) -> Future:
        return self.pool.submit(call, self.client)


class ReplicaLanes:
    """Control calls to every engine replica (see the module docstring). ``clients``: replica
    index -> control client. Subclasses say what a refit calls: :meth:`receive_call` runs while
    the replica receives, :meth:`land_call` after its group carried the refit, and
    :meth:`connect_call` when a replica joins. ``timeout_s``: the longest a landing replica's
    calls may take (``refit.timeout_s``)."""

    engine = "engine"

    def __init__(self, clients: dict[int, Any], *, timeout_s: float) -> None:
        if not clients:
            raise ValueError("ReplicaLanes needs at least one engine replica's client")
        self.timeout_s = timeout_s
        self.lanes = {replica: _Lane(replica, client) for replica, client in sorted(clients.items())}
        self._highest = max(self.lanes)

    # -- what one refit calls (the engine's) -----------------------------------------------------
    def receive_call(self, version: int, full: bool) -> Callable[[Any], Any]:
        raise NotImplementedError

    def land_call(self, version: int) -> Callable[[Any], Any]:
        raise NotImplementedError

    def connect_call(self, replica: int) -> Callable[[Any], Any]:
        raise NotImplementedError


    # -- the fleet's hooks -----------------------------------------------------------------------
    def start(self, replica: int, version: int, full: bool) -> None:
        """Before replica ``replica``'s bytes move: its receiving call, queued in its lane."""
        lane = self.lanes.get(replica)
        if lane is None:  # a member that joined without a client: nothing drives its engine here
            logger.warning("refit %d: engine replica %d has no control client on this train rank", version, replica)
            return
        lane.pending = lane.submit(self.receive_call(version, full))

    def land(self, replica: int, version: int) -> None:
        """After replica ``replica``'s group carried refit ``version``: its receiving call's
        outcome, then the call that makes the version live (``EngineLoadError`` if either failed)."""
        lane = self.lanes.get(replica)
        if lane is None:
            return
        pending, lane.pending = lane.pending, None
        if pending is not None:
            reason = _outcome(pending, self.timeout_s)
            if reason:
                raise EngineLoadError(f"{self.engine} replica {replica}: receiving version {version} failed: {reason}")
        reason = _outcome(lane.submit(self.land_call(version)), self.timeout_s)
        if reason:
            raise EngineLoadError(f"{self.engine} replica {replica}: making version {version} live failed: {reason}")

    def score(self, replica: int, sequences) -> list[list[float]]:
        """Once replica ``replica`` serves the new version: its per-token log-probs of ``sequences``
        through its client's ``score`` (its serving path), in its lane, within ``timeout_s``;
        :class:`~megatron_refit.fleet.serving.ServingUnavailableError` where its client has none. A
        replica whose answer fails the check is held (:meth:`hold`) until a version lands."""
        lane = self.lanes.get(replica)
        if lane is None or not callable(getattr(lane.client, "score", None)):
            what = "no control client" if lane is None else f"a {type(lane.client).__name__} without score()"
            raise ServingUnavailableError(f"train rank 0 holds {what} for {self.engine} replica {replica}")
        future = lane.submit(lambda client: client.score([list(s) for s in sequences]))
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise EngineLoadError(f"{self.engine} replica {replica}: scoring the serving probe did not return within "
                                  f"refit.timeout_s={self.timeout_s:g} s") from None

    def hold(self, replica: int) -> None:
        """Replica ``replica`` failed its serving check: stop it serving (its client's ``hold()``,
        where it has one: vLLM's server pauses), queued in its lane, not waited for; the next
        version that lands on it resumes it."""
        lane = self.lanes.get(replica)
        if lane is not None and callable(getattr(lane.client, "hold", None)):
            lane.submit(lambda client: client.hold())

    # -- membership ------------------------------------------------------------------------------
    @property
    def replicas(self) -> list[int]:
        return sorted(self.lanes)

    def add(self, client, *, replica: int | None = None, announced: Callable[[int], str | None]) -> int:
        """Train rank 0, between refits: a new engine replica (``client``: its control client)
        joins under index ``replica`` (default: one past every index so far; the index of a
        replica that died, to restart it). Its connect call starts in a lane of its own;
        returns (the index) once its join is announced (``announced(replica)``: the replica's
        latest announced incarnation, :meth:`~megatron_refit.fleet.trainer_fleet.TrainerFleet.announced`),
        so the train ranks take it in at their next refit."""
        if replica is None:
            replica = self._highest + 1
        if not isinstance(replica, int) or isinstance(replica, bool) or replica < 0:
            raise ValueError(f"replica must be a non-negative int, got {replica!r}")
        if replica in self.lanes:
            self.drop(replica)  # a restart under its index: the old lane's engine is gone
        self._highest = max(self._highest, replica)
        before = announced(replica)
        lane = self.lanes[replica] = _Lane(replica, client)
        connecting = lane.submit(self.connect_call(replica))
        deadline = time.monotonic() + self.timeout_s
        while announced(replica) == before:
            if connecting.done():  # it failed before it announced: nothing will take it in
                self.drop(replica)
                connecting.result()
                raise RuntimeError(f"{self.engine} replica {replica}: its connect call returned before it joined")
            if time.monotonic() > deadline:
                self.drop(replica)
                raise EngineLoadError(f"{self.engine} replica {replica} did not announce its join within "
                                      f"refit.timeout_s={self.timeout_s:g} s")
            time.sleep(0.02)
        return replica

    def drop(self, replica: int) -> None:
        """Forget replica ``replica``'s lane without waiting for its calls (its engine may hang)."""
        lane = self.lanes.pop(replica, None)
        if lane is not None:
            lane.pool.shutdown(wait=False, cancel_futures=True)

    def refit(self, fleet, version: int, *, full: bool = False):
        """Train rank 0's refit through ``fleet`` (a :class:`~megatron_refit.fleet.trainer_fleet.TrainerFleet`)
        with each replica's calls in its lane around its part; then the lanes of replicas the
        fleet no longer holds are dropped."""
        try:
            return fleet.refit(version, full=full, hooks=self)
        finally:
            self.keep(fleet.members)

    def keep(self, members) -> None:
        """After a refit: drop the lanes of replicas the fleet no longer holds (left, or their
        group broke)."""
        for replica in [r for r in self.lanes if r not in members]:
            logger.info("refit: engine replica %d is no longer a member; its control client is dropped", replica)
            self.drop(replica)

    def all(self, call: Callable[[int, Any], Any], what: str, *, local: Callable[[], Any] | None = None):
        """``call(replica, client)`` in every lane at once, while this thread runs ``local()``
        (the train rank's side of the same collective); returns what ``local`` returned.
        Raises ``local``'s error first, else the first replica's, named, once every call
        returned."""
        futures = {r: lane.submit(lambda c, r=r: call(r, c)) for r, lane in self.lanes.items()}
        try:
            out = local() if local is not None else None
        finally:
            errors = {r: f.exception() for r, f in futures.items()}
        for replica, exc in sorted(errors.items()):
            if exc is not None:
                raise RuntimeError(f"{self.engine} replica {replica}: its {what} call failed: {exc}") from exc
        return out

    def close(self) -> None:
        for replica in list(self.lanes):
            self.drop(replica)


def _outcome(future: Future, timeout_s: float) -> str:
    """What went wrong with an engine call (``""``: it returned), waiting up to ``timeout_s``."""
    try:
        future.result(timeout=timeout_s)
    except FutureTimeout:
        return f"it did not return within refit.timeout_s={timeout_s:g} s"
    except Exception as exc:  # noqa: BLE001 -- the engine's own error, named
        return f"{type(exc).__name__}: {exc}"[:500]
    return ""
