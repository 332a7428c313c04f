"""``refit.engine: sglang``'s :class:`~megatron_refit.engines.control.EngineControl`: train rank 0
drives every SGLang engine replica's control client around the train ranks' refit.

Every call to one replica runs in that replica's lane (:class:`~megatron_refit.fleet.lanes.ReplicaLanes`):
its connect (the workers join the refit group), per refit its update session (pause, then
``update_weights_from_tensor`` with the ``refit`` message, which returns once its workers
received) while its bytes move, and its resume (tagged with the version) once its group carried
the refit, and its close. A replica that failed stays paused (its weights are no complete
version); its next refit that lands resumes it. :meth:`~megatron_refit.fleet.trainer_fleet.TrainerFleet.add`
takes in a new engine (or a restarted one) while the trainer runs: it gets the current version
in full at the next refit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from megatron_refit.config import RefitConfig
from megatron_refit.fleet.lanes import ReplicaLanes


class SglangControl(ReplicaLanes):
    """Control of SGLang engine replicas (``clients``: an
    :class:`~megatron_refit.engines.sglang.trainer.client.EngineClient` or
    :class:`~megatron_refit.engines.sglang.trainer.client.HTTPClient` per replica, replica ``i`` =
    ``clients[i]``; train rank 0 drives them, the other train ranks pass them or none).
    ``refit``: the ``refit:`` section (sent to every engine at connect)."""

    engine = "SGLang engine"

    def __init__(self, clients: Sequence, refit: RefitConfig) -> None:
        if isinstance(refit, RefitConfig) and refit.engine != "sglang":
            raise ValueError(f"SglangControl drives SGLang engines, but refit.engine is {refit.engine!r}: set engine: "
                             "sglang (engine_control(refit, clients) picks the control refit.engine names)")
        super().__init__(clients, refit)
        self.refit_section = self.cfg.to_wire()
        """What every engine gets at connect (the wire form of :attr:`cfg`)."""

    def connect_call(self, replica: int, num_train: int) -> Callable[[Any], Any]:
        return lambda client: client.connect(self.refit_section, num_train=num_train, replica=replica)

    def receive_call(self, version: int, full: bool) -> Callable[[Any], Any]:
        return lambda client: client.refit(version, full=full)

    def land_call(self, version: int) -> Callable[[Any], Any]:
        return lambda client: client.resume(version)

    def close_call(self) -> Callable[[Any], Any]:
        return lambda client: client.close()
