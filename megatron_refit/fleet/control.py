"""What the fleet may ask of an engine's control plane: :class:`EngineControl`.

An engine with a control plane (vLLM's weight-transfer API, SGLang's update sessions) takes calls
from train rank 0 when a replica joins, around each replica's part of every refit, and at the
end. The fleet (:class:`~megatron_refit.fleet.trainer_fleet.TrainerFleet`) is built with the
control (constructor injection, train rank 0) and is the only caller: it connects each replica,
calls the control around the replica's refit in that replica's refit lane, and closes it. The
control never calls the fleet back and holds no reference to it; what the fleet needs from a call
(a connect that failed, an engine that did not land) comes back as the call's result: a future,
or an error. :class:`~megatron_refit.fleet.lanes.ReplicaLanes` is the control of every engine
with one (one lane of its own per replica); an engine without a control plane (it runs its own
receive loop: the HF engine) has none, and the fleet is built without one.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class EngineControl(Protocol):
    """Train rank 0's calls to the engine replicas' control plane, each about one replica; an
    error from one fails that replica alone."""

    engine: str
    """How errors name its engine (``"vLLM engine"``: "the vLLM engine's connect call failed: …")."""

    staged: bool
    """``swap: staged``: each engine rank notes whether it prepared the version beside the live
    model (:func:`~megatron_refit.group.store.note_swap`)."""

    @property
    def replicas(self) -> list[int]:
        """The replicas it holds a client for, by index."""

    def connect(self, replica: int, *, num_train: int, client: Any = None) -> Future | None:
        """Start replica ``replica``'s connect call (its engine joins the refit group and prepares
        the plan with the ``num_train`` train ranks); ``client``: a new client for it (a replica
        that joins while the trainer runs, or a restarted one under its index). Returns the call's
        future (it fails where the engine refuses), None where the engine connects by itself."""

    def start(self, replica: int, version: int, full: bool) -> None:
        """Before the replica's bytes move (its engine's receiving call, not waited for)."""

    def land(self, replica: int, version: int, *, gate: bool = False) -> None:
        """Once its group carried the refit: the engine makes the version live (or raises);
        ``gate``: its serving check follows, and an engine that can keeps traffic off the
        version until :meth:`release`."""

    def release(self, replica: int, *, passed: bool) -> None:
        """The verdict on a version :meth:`land` gated: traffic goes on (``passed``) or the
        engine holds."""

    def score(self, replica: int, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Once the version is live: the engine's per-token log-probs of ``sequences`` through its
        serving path (:class:`~megatron_refit.fleet.serving.ServingUnavailableError` if it has none)."""

    def hold(self, replica: int) -> None:
        """It failed its serving check: stop it serving what it serves, where its engine can."""

    def forget(self, replica: int) -> None:
        """The fleet dropped it (it left, or its group broke, or it never joined): its client and
        calls go, not waited for."""

    def close(self, *, tell: bool = True, wait_s: float = 0.0) -> list[str]:
        """The end: (``tell``) every engine is told, all at once, within a bound the control
        states; then its threads end, waited for ``wait_s`` in all. ``tell=False``: an abort (an
        exit without ``close``): no engine is told. Returns the threads still in a call (each a
        daemon that ends with it)."""
