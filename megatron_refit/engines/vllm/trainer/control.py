"""``refit.engine: vllm``'s :class:`~megatron_refit.engines.control.EngineControl`: train rank 0
drives every vLLM engine replica through vLLM's own weight-transfer API (its
``VLLMWeightSyncClient`` protocol: ``LLMClient``, ``HTTPClient``), one engine per replica.

Every call to one replica runs in that replica's lane (:class:`~megatron_refit.fleet.lanes.ReplicaLanes`):
``init_weight_transfer_engine`` when it joins (the engine's workers join the refit group and
prepare the plan), per refit ``start_weight_update`` + ``update_weights`` while its bytes move and
``finish_weight_update`` (with the version as vLLM's weight version) once its group carried them,
and ``shutdown_weight_transfer_engine`` at the end. The trainer engine of the ``megatron_refit``
backend (:mod:`megatron_refit.engines.vllm.trainer.engine`) and ``RefitCallback(engines=[...])``
drive vLLM engines through it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from megatron_refit.config import RefitConfig
from megatron_refit.engines.vllm.payload import init_payload, update_payload
from megatron_refit.fleet.lanes import ReplicaLanes


class VllmControl(ReplicaLanes):
    """Control of vLLM engine replicas (``clients``: one ``VLLMWeightSyncClient`` per replica,
    replica ``i`` = ``clients[i]``; a wide expert-parallel deployment of a MoE model at
    ``--data-parallel-size D`` is one replica, its client a
    :class:`~.deployment_client.DeploymentClient` of its DP ranks' servers). ``lora``: the LoRA
    adapters' ``(rank, alpha)`` the engines merge (``(0, 0.0)``: none)."""

    engine = "vLLM engine"

    def __init__(self, clients: Sequence, refit: RefitConfig, *, lora: tuple[int, float] = (0, 0.0)):
        super().__init__(clients, refit)
        self.lora = lora

    def connect_call(self, replica: int, num_train: int) -> Callable[[Any], Any]:
        info = {**init_payload(self.cfg, num_train=num_train, lora_rank=self.lora[0], lora_alpha=self.lora[1]),
                "replica": replica}

        def connect(client) -> None:
            if self.cfg.gen_draft and not callable(getattr(client, "start_draft_weight_update", None)):
                raise ValueError(f"refit.gen_draft: replica {replica}'s client {type(client).__name__} has no "
                                 "start_draft_weight_update (vLLM's draft session, in which the draft lands)")
            client.init_weight_transfer_engine(info)
        return connect

    def receive_call(self, version: int, full: bool) -> Callable[[Any], Any]:
        update = update_payload(version, full=full)
        if self.cfg.gen_draft:  # vLLM's draft session: the version lands in the model and its draft at once
            return lambda client: (client.start_draft_weight_update(), client.update_weights(update))
        return lambda client: (client.start_weight_update(), client.update_weights(update))

    def land_call(self, version: int) -> Callable[[Any], Any]:
        if self.cfg.swap != "staged":
            return lambda client: client.finish_weight_update(str(version))
        complete = update_payload(version, full=True, complete=True)

        def land(client) -> None:  # staged: its failures before the swap end the update, no pause taken
            client.update_weights(complete)
            client.finish_weight_update(str(version))
        return land

    def close_call(self) -> Callable[[Any], Any]:
        def shutdown(client) -> None:
            release = getattr(client, "shutdown_weight_transfer_engine", None)
            if release is not None:
                release()
        return shutdown
