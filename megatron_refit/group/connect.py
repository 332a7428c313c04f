"""What both sides check and open to join a replica's refit group: the ``refit:`` section's
preconditions (:func:`check_enabled`, :func:`check_lora_sync`), the group itself (:func:`connect`)
and the bound of a relay link's waits (:func:`relay_wait_s`)."""

from __future__ import annotations

import torch

from megatron_refit.config import RefitConfig
from megatron_refit.config.deployment import refuse_wide_ep
from megatron_refit.group.beats import stall_s
from megatron_refit.group.store import namespace
from megatron_refit.transport import open_transport, transport_name


def connect(cfg: RefitConfig, *, refit_rank: int, num_train: int, device: torch.device, replica: int,
            incarnation: str):
    """This rank's end of engine replica ``replica``'s refit group (the train ranks and that
    replica's ``replica_size`` ranks, in the train ranks' store at ``refit.port`` under the
    replica's incarnation: :func:`~megatron_refit.group.store.namespace`) over ``refit.transport``
    (``auto``: NCCL between GPUs, gloo on CPU; colocated: bucket bytes through shared buffers
    (CUDA IPC / shared memory), control messages over gloo)."""
    world = num_train + cfg.replica_size
    if not 0 <= refit_rank < world:
        raise ValueError(f"refit rank {refit_rank} outside a replica's refit group of {world} "
                         f"(num_train={num_train} + replica_size={cfg.replica_size})")
    name = transport_name(cfg.transport, colocated=cfg.mode == "colocated", device=device)
    return open_transport(name, host=cfg.host, port=cfg.port, rank=refit_rank, world_size=world,
                          timeout_s=cfg.timeout_s, num_train=num_train, device=device,
                          namespace=namespace(replica, incarnation))


def check_lora_sync(cfg: RefitConfig) -> None:
    if cfg.lora_sync == "merged":
        raise ValueError("refit.lora_sync 'merged' (trainer-side merge) is not implemented: use 'adapters' or "
                         "'auto' (adapters sent, merged by the engine's receiver) or 'full'")


def check_enabled(cfg: RefitConfig, num_train: int) -> None:
    """Where a refit starts, on the train ranks and every engine's: ``cfg`` is on, and names no
    wide expert-parallel deployment (:func:`~megatron_refit.config.deployment.refuse_wide_ep`)."""
    if not cfg.enabled:
        raise ValueError("refit.enabled is false: set enabled: true in the refit section of the training config")
    refuse_wide_ep(cfg)
    if not isinstance(num_train, int) or num_train < 1:
        raise ValueError(f"num_train must be a positive int, got {num_train!r}")


def relay_wait_s(cfg: RefitConfig) -> float:
    """``refit.fanout``: the bound of every wait on a relay link (joining it, a bucket forwarded or
    awaited): ``refit.stall_s`` where it is on (a relay or successor that stops is given up on as
    soon as the train ranks would call it stalled), else ``refit.timeout_s``."""
    return stall_s(cfg) or cfg.timeout_s
