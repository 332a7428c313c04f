"""``refit.engine: sglang``'s :class:`~megatron_refit.engines.control.EngineControl`: train rank 0
drives every SGLang engine replica's control client around the train ranks' refit.

Every call to one replica runs in that replica's lane
(:class:`~megatron_refit.fleet.lanes.ReplicaLanes`): per refit, its update session
(pause, then ``update_weights_from_tensor`` with the ``refit`` message, which returns once its
workers received) while its bytes move, and its resume (tagged with the version) once its group
carried the refit. A replica that failed stays paused (its weights are no complete version);
its next refit that lands resumes it. :meth:`SglangControl.add` takes in a new engine (or a
restarted one) while the trainer runs: it gets the current version in full at the next refit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from megatron_refit.config import refit_section
from megatron_refit.fleet.store import abort_start
from megatron_refit.fleet.lanes import ReplicaLanes


class SglangControl(ReplicaLanes):
    """Control of SGLang engine replicas (``clients``: an
    :class:`~megatron_refit.engines.sglang.trainer.client.EngineClient` or
    :class:`~megatron_refit.engines.sglang.trainer.client.HTTPClient` per replica, replica ``i`` =
    ``clients[i]``; train rank 0 drives them, the other train ranks pass them or none).
    ``refit``: the ``refit:`` section as a mapping (sent to every engine at connect)."""

    engine = "SGLang engine"

    def __init__(self, clients: Sequence, refit: dict) -> None:
        cfg = refit_section({"engine": "sglang", **dict(refit)}, "refit")
        if len(clients) != cfg.gen_dp:
            raise ValueError(f"SglangControl: {len(clients)} engine clients for refit.gen_dp={cfg.gen_dp} replicas: "
                             "pass one client per starting replica (engines that start later join through add)")
        super().__init__(dict(enumerate(clients)), timeout_s=cfg.timeout_s)
        self.cfg = cfg
        self.refit_section = dict(refit)
        self._num_train: int | None = None
        self._fleet = None

    # -- the calls of one replica ----------------------------------------------------------------
    def receive_call(self, version: int, full: bool) -> Callable[[Any], Any]:
        return lambda client: client.refit(version, full=full)

    def land_call(self, version: int) -> Callable[[Any], Any]:
        return lambda client: client.resume(version)

    def connect_call(self, replica: int) -> Callable[[Any], Any]:
        return lambda client: client.connect(self.refit_section, num_train=self._num_train, replica=replica)

    # -- EngineControl ---------------------------------------------------------------------------
    def connect(self, join: Callable[[], Any], *, rank: int, num_train: int):
        """Every train rank: join the refit (``join()``, returns the trainer's refit) while rank 0
        connects every engine replica."""
        self._num_train = num_train
        if rank != 0:
            return join()
        def connect_engine(replica, client):
            try:
                self.connect_call(replica)(client)
            except Exception as exc:  # every train rank stops waiting for the engines now
                abort_start(self.cfg, f"SGLang engine replica {replica}'s connect failed: {type(exc).__name__}: {exc}")
                raise

        self._fleet = self.all(connect_engine, "connect", local=join)
        return self._fleet

    def refit(self, fleet, version: int, *, rank: int, full: bool = False):
        """Every train rank, every step: ``fleet.refit(version)``; rank 0 pauses and updates each
        replica while its bytes move and resumes each one that landed the version."""
        if rank != 0:
            return fleet.refit(version, full=full)
        return super().refit(fleet, version, full=full)

    def close(self, fleet, *, rank: int) -> None:
        """Every train rank: leave the refit while rank 0 closes every replica's side."""
        if rank != 0:
            fleet.close()
            return
        self.all(lambda replica, client: client.close(), "close", local=fleet.close)
        super().close()

    def add(self, client, *, replica: int | None = None) -> int:
        """Train rank 0, between refits: engine ``client`` joins as replica ``replica`` (default:
        a new index; a dead replica's index to restart it) and gets the current version in full
        at the next refit; returns its index."""
        if self._fleet is None:
            raise ValueError("SglangControl.add: only train rank 0, after connect, takes in engines")
        return super().add(client, replica=replica, announced=self._fleet.announced)
