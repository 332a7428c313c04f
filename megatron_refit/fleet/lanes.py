"""Train rank 0's control calls to each engine replica, one lane per replica: the
:class:`~megatron_refit.fleet.control.EngineControl` of every engine with a control plane (vLLM's
weight-transfer calls, SGLang's update sessions).

An engine with a control plane takes calls from train rank 0 around every refit: before the bytes
move (pause, ``update_weights``) and after (``finish_weight_update`` / resume); once when it joins
(``init_weight_transfer_engine`` / connect) and when it leaves. With many replicas, one replica's
trouble must stay with it, so every replica's client gets a lane of this control's own runner
(:class:`~megatron_refit.fleet.runner.Runner`: one named thread, ``control-<r>-<n>``, running its
calls in order, apart from the other replicas'; joined on :meth:`~ReplicaLanes.close`). The fleet,
built with this control on train rank 0, is its only caller: it calls :meth:`~ReplicaLanes.connect`
as each replica starts or joins (the future it gets back tells it a connect that failed),
:meth:`~ReplicaLanes.start` in the replica's own refit lane before its bytes move and
:meth:`~ReplicaLanes.land` once its group carried the refit, so a replica whose engine cannot make
the version live fails alone, named in the report like any other failed replica, and only
replicas that landed the version resume serving. A replica that failed stays paused (its weights
are no complete version) until a refit lands on it; one the fleet drops is forgotten with its
lane, without waiting for it. Nothing here calls the fleet back.

Subclasses say what each call is (:meth:`connect_call`, :meth:`receive_call`, :meth:`land_call`,
:meth:`close_call`).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from megatron_refit.config import RefitConfig, typed_section
from megatron_refit.errors import EngineLoadError
from megatron_refit.fleet.runner import Runner
from megatron_refit.fleet.serving import ServingUnavailableError

logger = logging.getLogger(__name__)

_LANE_IDS = itertools.count()


@runtime_checkable
class ClientScores(Protocol):
    """Optional for a control client: the serving probe through its engine's serving path, each
    sequence's per-token log-probs (vLLM's ``HTTPClient`` / ``LLMClient``, SGLang's clients)."""

    def score(self, sequences: list[list[int]]) -> list[list[float]]: ...


@runtime_checkable
class ClientGates(Protocol):
    """Optional: keep traffic off the version about to land (``gate``: the offline ``LLM``'s
    generate calls wait) until the verdict, at most ``timeout_s``: ``release()`` where it passed,
    ``hold()`` where it failed."""

    def gate(self, timeout_s: float) -> None: ...

    def release(self) -> None: ...

    def hold(self) -> None: ...


@runtime_checkable
class ClientHolds(Protocol):
    """Optional: stop the engine serving what it serves (vLLM's server pauses) until a version lands."""

    def hold(self) -> None: ...


CLOSE_WAIT_S = 10.0
"""How long :meth:`ReplicaLanes.close` waits for the engines' close calls (each told at once)."""


@dataclass
class _Client:
    """One replica's control client and its lane (a new lane per client: a restarted replica's
    calls never queue behind its dead predecessor's)."""

    client: Any
    lane: str
    pending: Future | None = None
    """The call whose outcome :meth:`ReplicaLanes.land` waits for (the receiving one)."""
    gated: bool = False
    """:meth:`ReplicaLanes.land` gated its client: the version is scored before it takes traffic."""


class ReplicaLanes:
    """Control calls to every engine replica (see the module docstring). ``clients``: one control
    client per replica the job starts with (replica ``i`` = ``clients[i]``; train rank 0 passes
    them, the other train ranks may pass them or none). ``refit``: the ``refit:`` section, a
    ``RefitConfig`` (parsed where it was read)."""

    engine = "engine"

    def __init__(self, clients: Sequence, refit: RefitConfig):
        self.cfg = typed_section(refit, type(self).__name__)
        self.staged = self.cfg.swap == "staged"
        """Each engine rank notes whether it prepared a version beside the live model (read after land)."""
        if clients and len(clients) != self.cfg.gen_dp:
            raise ValueError(f"{type(self).__name__}: {len(clients)} engine clients for refit.gen_dp={self.cfg.gen_dp} "
                             "replicas: pass one client per starting replica (engines that start later join through "
                             "the fleet's add)")
        self.timeout_s = self.cfg.timeout_s
        self._clients: dict[int, _Client] = {r: self._new(r, c) for r, c in enumerate(clients)}
        self._lock = threading.Lock()
        self._runner = Runner()
        """The lanes of this control's calls (one per replica's client), joined on :meth:`close`."""

    @staticmethod
    def _new(replica: int, client) -> _Client:
        return _Client(client, f"control-{replica}-{next(_LANE_IDS)}")

    # -- what each call is (the engine's) --------------------------------------------------------
    def connect_call(self, replica: int, num_train: int) -> Callable[[Any], Any]:
        raise NotImplementedError

    def receive_call(self, version: int, full: bool) -> Callable[[Any], Any]:
        raise NotImplementedError

    def land_call(self, version: int) -> Callable[[Any], Any]:
        raise NotImplementedError

    def close_call(self) -> Callable[[Any], Any] | None:
        """What a replica's engine is told when the trainer closes (None: nothing)."""
        return None

    # -- EngineControl: the fleet's calls ----------------------------------------------------------
    def connect(self, replica: int, *, num_train: int, client: Any = None) -> Future:
        """Replica ``replica``'s connect call, started in its lane (``client``: a new client for it;
        a restarted replica's old lane is retired, not waited for: its engine is gone)."""
        with self._lock:
            if client is not None:
                old = self._clients.pop(replica, None)
                if old is not None:
                    self._runner.retire(old.lane)
                self._clients[replica] = self._new(replica, client)
            entry = self._clients.get(replica)
            if entry is None:
                raise ValueError(f"{type(self).__name__}.connect: no client for {self.engine} replica {replica}")
            return self._submit(entry, self.connect_call(replica, num_train))

    def close(self, *, tell: bool = True, wait_s: float = 0.0) -> list[str]:
        """(``tell``) every replica's engine is told, each in its lane, all at once, waited for up
        to :data:`CLOSE_WAIT_S` (an engine that hangs is not waited for longer: it is told, its
        lane ends with the call); then the lanes end, waited for ``wait_s`` in all. Returns the
        lanes still in a call (each a daemon thread that ends with it)."""
        call = self.close_call() if tell else None
        if call is not None:
            with self._lock:
                futures = {r: self._submit(e, call) for r, e in self._clients.items()}
            wait(list(futures.values()), timeout=min(self.timeout_s, CLOSE_WAIT_S))
            for replica, future in sorted(futures.items()):
                reason = _outcome(future, 0.0)
                if reason:
                    logger.warning("refit: telling %s replica %d to close failed: %s", self.engine, replica, reason)
        return self._runner.close(wait_s)

    def _submit(self, entry: _Client, call: Callable[[Any], Any]) -> Future:
        return self._runner.submit(entry.lane, call, entry.client)

    def _entry(self, replica: int) -> _Client | None:
        with self._lock:
            return self._clients.get(replica)

    def start(self, replica: int, version: int, full: bool) -> None:
        """Before replica ``replica``'s bytes move: its receiving call, queued in its lane."""
        entry = self._entry(replica)
        if entry is None:  # a member that joined without a client: nothing drives its engine here
            logger.warning("refit %d: engine replica %d has no control client on this train rank", version, replica)
            return
        entry.pending = self._submit(entry, self.receive_call(version, full))

    def land(self, replica: int, version: int, *, gate: bool = False) -> None:
        """After replica ``replica``'s group carried refit ``version``: its receiving call's
        outcome, then the call that makes the version live (``EngineLoadError`` if either failed).
        ``gate`` (its serving check follows): a client that can keep traffic off the version
        until the verdict (``gate(timeout_s)``: the offline ``LLM``) does so from before it lands;
        :meth:`release` ends it."""
        entry = self._entry(replica)
        if entry is None:
            return
        pending, entry.pending = entry.pending, None
        if pending is not None:
            reason = _outcome(pending, self.timeout_s)
            if reason:
                raise EngineLoadError(f"{self.engine} replica {replica}: receiving version {version} failed: {reason}")
        if gate and isinstance(entry.client, ClientGates):
            # land, score and verdict each within timeout_s: the gate opens or holds before 3 x timeout_s
            self._submit(entry, lambda client: client.gate(3 * self.timeout_s))
            entry.gated = True
        reason = _outcome(self._submit(entry, self.land_call(version)), self.timeout_s)
        if reason:
            raise EngineLoadError(f"{self.engine} replica {replica}: making version {version} live failed: {reason}")

    def score(self, replica: int, sequences) -> list[list[float]]:
        """Once replica ``replica`` serves the new version: its per-token log-probs of ``sequences``
        through its client's ``score`` (its serving path), in its lane, within ``timeout_s``;
        :class:`~megatron_refit.fleet.serving.ServingUnavailableError` where its client has none. A
        replica whose answer fails the check is held (:meth:`hold`) until a version lands."""
        entry = self._entry(replica)
        if entry is None or not isinstance(entry.client, ClientScores):
            what = "no control client" if entry is None else f"a {type(entry.client).__name__} without score()"
            raise ServingUnavailableError(f"train rank 0 holds {what} for {self.engine} replica {replica}")
        future = self._submit(entry, lambda client: client.score([list(s) for s in sequences]))
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise EngineLoadError(f"{self.engine} replica {replica}: scoring the serving probe did not return within "
                                  f"refit.timeout_s={self.timeout_s:g} s") from None

    def hold(self, replica: int) -> None:
        """Replica ``replica`` failed its serving check: stop it serving (its client's ``hold()``,
        where it has one: vLLM's server pauses), in its lane, waited for up to ``timeout_s`` so the
        replica no longer serves the wrong model once the refit reports its failure (a hold that
        fails or does not return is logged: the failure is reported all the same); the next version
        that lands on it resumes it."""
        entry = self._entry(replica)
        if entry is not None:
            entry.gated = False  # a hold ends a gate (a waiting generate is refused)
        if entry is not None and isinstance(entry.client, ClientHolds):
            reason = _outcome(self._submit(entry, lambda client: client.hold()), self.timeout_s)
            if reason:
                logger.error("%s replica %d failed its serving check and could not be held: %s",
                             self.engine, replica, reason)

    def release(self, replica: int, *, passed: bool) -> None:
        """The verdict on a replica :meth:`land` gated: it ``passed`` (traffic goes on, over the
        version; also where it could not be scored under ``auto``) or not (its client holds: a
        waiting ``generate`` is refused). Nothing where the client was not gated."""
        entry = self._entry(replica)
        if entry is None or not entry.gated:
            return
        entry.gated = False
        reason = _outcome(self._submit(entry, lambda client: client.release() if passed else client.hold()),
                          self.timeout_s)
        if reason:
            logger.error("%s replica %d: ending its serving check's gate failed: %s", self.engine, replica, reason)

    def forget(self, replica: int) -> None:
        """The fleet dropped replica ``replica`` (it left, or its group broke): its client and lane
        go, without waiting for its calls (its engine may hang)."""
        with self._lock:
            entry = self._clients.pop(replica, None)
        if entry is not None:
            self._runner.retire(entry.lane)

    @property
    def replicas(self) -> list[int]:
        with self._lock:
            return sorted(self._clients)

    @property
    def clients(self) -> list:
        """The current replicas' clients, by replica index."""
        with self._lock:
            return [self._clients[r].client for r in sorted(self._clients)]


def _outcome(future: Future, timeout_s: float) -> str:
    """What went wrong with an engine call (``""``: it returned), waiting up to ``timeout_s``."""
    try:
        future.result(timeout=timeout_s)
    except FutureTimeout:
        return f"it did not return within refit.timeout_s={timeout_s:g} s"
    except Exception as exc:  # noqa: BLE001 -- the engine's own error, named
        return f"{type(exc).__name__}: {exc}"[:500]
    return ""
