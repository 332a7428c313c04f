"""The storage protocol: what a generation engine gives :class:`~megatron_refit.endpoint.receiver.Receiver`
(the memory its pieces land in), and the weight states it goes through.

An engine's :class:`Storage` holds this generation rank's pieces (the engines under
:mod:`megatron_refit.engines` implement it). The receiver moves it through ``stale → updating → ready`` (back
to ``stale`` on any failure) and tells it each change; :class:`WeightsState` is the guard
every receiver in this package keeps, so an engine can refuse to serve weights that are not
those of a complete refit. Nothing here imports the endpoint, a transport or Megatron.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol, runtime_checkable

import torch

from megatron_refit.errors import StaleWeightsError
from megatron_refit.plan.spec import ShardSpec

STATES = ("stale", "updating", "ready")
"""``stale``: not the weights of a complete refit (before the first, or after a failed one);
``updating``: a refit is writing into them; ``ready``: the weights of refit ``weights_version``."""


class Storage(Protocol):
    """What a generation engine provides to :class:`~megatron_refit.endpoint.receiver.Receiver`."""

    def target_specs(self) -> list[ShardSpec]:
        """The pieces of HF tensors this generation rank holds (HF names, global boxes)."""

    def buffer(self, name: str) -> torch.Tensor:
        """Engine storage for the piece ``name``, shaped like its box (written in place)."""

    def finalize(self) -> None:
        """Post-load step, once all pieces of a refit are in."""


@runtime_checkable
class TracksState(Protocol):
    """Optional: told every state change (``stale`` → ``updating`` → ``ready``, or back to
    ``stale`` on failure), so the engine can refuse to serve half-updated weights."""

    def set_state(self, state: str, version: int | None) -> None: ...


@runtime_checkable
class RefreshesTargets(Protocol):
    """Optional: called at the start of every refit, before any byte moves. A storage over a
    live engine checks that the storage it writes into is still the engine's (re-resolving
    it if the engine re-allocated its parameters; True then, and that refit is a full one,
    never a delta) and raises if it cannot be; every rank then ends the refit with an error
    (``RefitAbortedError``)."""

    def refresh_targets(self) -> bool | None: ...


@runtime_checkable
class MovesExperts(Protocol):
    """Optional: an engine whose load balancer (EPLB) moves routed experts between its slots
    while serving. Called at the start of every refit, before any byte moves, after
    :class:`RefreshesTargets`: reads the engine's current map; True where it differs from the
    one the storage's target specs were built for (they are rebuilt for it: every rank of the
    refit group then re-plans the experts and the refit lands in the new map, as a full one);
    ``ValueError`` naming what is wrong where the map cannot be read (every rank then ends the
    refit with an error before any byte moves)."""

    def refresh_experts(self) -> bool: ...


@runtime_checkable
class ExpectsVersion(Protocol):
    """Optional: told the version a refit will deliver before its bytes move (a staged
    receiver makes it live, tagged with that version, at the swap)."""

    def expect_version(self, version: int) -> None: ...


@runtime_checkable
class GatesTraffic(Protocol):
    """Optional: keeps traffic off a version until its serving check passed
    (``refit.verify_serving``: the version is scored before it takes traffic). The receiver
    calls :meth:`gate` at the start of a checked refit; the engine's member calls
    :meth:`release` once the verdict is in (a failed one holds the weights first)."""

    def gate(self, version: int) -> None: ...

    def release(self) -> None: ...


@runtime_checkable
class ScoresProbe(Protocol):
    """Optional: scores the serving probe through the engine's own forward (``refit.verify_serving``
    in band): each sequence's ``log p(token t | tokens < t)`` for every token after the first."""

    def score(self, sequences) -> list[list[float]]: ...


@runtime_checkable
class HoldsWeights(Protocol):
    """Optional: refuses to serve the weights it holds (``why``) until the next refit lands (a
    version that failed its serving check)."""

    def hold(self, why: str) -> None: ...


@runtime_checkable
class ReportsVersion(Protocol):
    """Optional: the version of the weights the engine holds (None before the first refit); a
    storage without it is taken to hold its receiver's last version."""

    weights_version: int | None


@runtime_checkable
class KeepsSentBytes(Protocol):
    """Optional: ``holds_sent_bytes`` True where the storage keeps exactly the bytes the last refit
    wrote (no post-load step transforms them in place): a delta refit can start from it. A storage
    without it always gets full refits."""

    holds_sent_bytes: bool


@runtime_checkable
class LiveBuffers(Protocol):
    """Optional: ``live_buffers`` True where :meth:`Storage.buffer` is the very tensor the engine
    serves after ``finalize()`` (the HF engine's): its weights can be read back and compared with
    what landed (``refit.verify_serving``)."""

    live_buffers: bool


_LOCKS = threading.Lock()


class WeightsState:
    """The stale / updating / ready guard of a receiver (see :data:`STATES`), and the lock
    its engine holds while a forward pass reads the weights (:attr:`serving`)."""

    holds_sent_bytes: bool = True
    """The storage keeps exactly the bytes the last refit wrote (no post-load step transforms
    them in place): a delta refit (``refit.delta``) can start from it. A storage without this
    attribute is assumed not to, and always gets full refits."""
    state: str = "stale"
    weights_version: int | None = None
    """Version of the last complete refit (None before the first)."""

    held: str | None = None
    """Why the engine refuses to serve the weights it holds (:meth:`hold`), until the next refit."""

    gated: int | None = None
    """A version under its serving check (:meth:`gate`): traffic's forward passes over it wait."""
    last_gate_s: float = 0.0
    """Seconds the last gated version was live before its verdict: what traffic waited on it."""
    _live_at: float | None = None

    def set_state(self, state: str, version: int | None) -> None:
        if state not in STATES:
            raise ValueError(f"receiver state must be one of {STATES}, got {state!r}")
        with self.serving:  # a forward pass under way finishes on the weights it started with
            self.state, self.weights_version, self.held = state, version, None
            self.went_live()

    def went_live(self) -> None:
        """(Holding :attr:`serving`) the state just changed: a gated version going live starts
        :attr:`last_gate_s`."""
        if self.state == "ready" and self.weights_version is not None and self.weights_version == self.gated:
            self._live_at = time.perf_counter()

    def hold(self, why: str) -> None:
        """The version these weights hold failed its serving check (``refit.verify_serving``,
        told in band): refuse to serve them (``stale``) until the next refit lands."""
        with self.serving:
            self.state, self.held = "stale", why
            self._gate_condition.notify_all()  # traffic waiting at the gate is refused now

    def gate(self, version: int) -> None:
        """Refit ``version`` is checked: from the moment it goes live until :meth:`release` (or
        :meth:`hold`), traffic's forward passes over it wait (:meth:`wait_gate`); the version
        before it serves on meanwhile (a staged swap), and the probe's scoring passes."""
        with self.serving:
            self.gated, self._live_at = version, None

    def release(self) -> None:
        """The verdict is in: traffic waiting at the gate goes on (over the version, or refused
        where it failed and was held). Nothing gated (an unchecked refit): no lock taken, no
        forward pass waited for."""
        if self.gated is None:  # set and cleared by the refit's own thread, this one
            return
        with self.serving:
            if self._live_at is not None:
                self.last_gate_s = time.perf_counter() - self._live_at
            self.gated = self._live_at = None
            self._gate_condition.notify_all()

    def wait_gate(self) -> None:
        """Traffic, holding :attr:`serving`: wait while the version it would read is under its
        check (the lock is free meanwhile: the probe scores, the verdict comes). The engine's
        member releases the gate in every case once its refit and check end (each bounded by
        ``refit.timeout_s``)."""
        while self.gated is not None and self.gated == self.weights_version and self.state == "ready":
            self._gate_condition.wait(timeout=1.0)

    @property
    def _gate_condition(self) -> threading.Condition:
        condition = self.__dict__.get("_gate_cv")
        if condition is None:
            lock = self.serving  # created first: it takes _LOCKS too
            with _LOCKS:
                condition = self.__dict__.setdefault("_gate_cv", threading.Condition(lock))
        return condition

    @property
    def serving(self) -> threading.Lock:
        """Held by every forward pass over the weights and by a staged swap: no forward pass
        sees two versions."""
        lock = self.__dict__.get("_serving")
        if lock is None:
            with _LOCKS:
                lock = self.__dict__.setdefault("_serving", threading.Lock())
        return lock

    def require_ready(self, what: str) -> None:
        """``StaleWeightsError`` unless the weights are those of a complete refit."""
        if self.held is not None:
            raise StaleWeightsError(f"{what}: the weights of refit {self.weights_version} failed their serving "
                                    f"check ({self.held}); refusing to serve until the next refit lands")
        if self.state != "ready":
            raise StaleWeightsError(f"{what}: weights are {self.state} (last complete refit: "
                                    f"{self.weights_version}); refusing to serve until a refit completes")
