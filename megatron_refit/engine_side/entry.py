"""The engine's entry point: :func:`engine_refit`, an engine rank joining its replica's refit group
(the train ranks' entry is :func:`megatron_refit.refit.trainer_refit_from_pieces`)."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import torch

from megatron_refit.config import RefitConfig
from megatron_refit.engine_side.heartbeat import Heartbeat
from megatron_refit.engine_side.member import EngineMember
from megatron_refit.group.connect import check_enabled, check_lora_sync, connect, relay_wait_s
from megatron_refit.group.store import JOINS, announce
from megatron_refit.transport import ProcessGroupTransport


def engine_refit(cfg: RefitConfig, storage, *, gen_index: int, num_train: int, device: str | torch.device = "cpu",
                 lora: tuple[int, float] | None = None,
                 on_report: Callable[[dict], None] | None = None) -> EngineMember:
    """Join the refit as engine rank ``gen_index`` (replica ``gen_index // cfg.replica_size``, its
    rank ``gen_index % cfg.replica_size`` in it: ``dp_rank * gen_tp + tp_rank`` in a deployment of
    ``gen_attention_dp`` data-parallel ranks) with the engine's ``storage`` (``target_specs`` / ``buffer`` /
    ``finalize``) and build the plan. The replicas ``0..gen_dp-1`` are those the trainer starts
    with; any other (or one that restarted) joins at the trainer's next refit and gets the
    current version in full. ``lora=(rank, alpha)``: the trainer sends LoRA adapters, merged
    here into the weights. ``close()`` leaves (the trainer drops the replica at its next refit)."""
    check_enabled(cfg, num_train)
    if not isinstance(gen_index, int) or gen_index < 0:
        raise ValueError(f"gen_index must be a non-negative int, got {gen_index!r}")
    replica, rank = divmod(gen_index, cfg.replica_size)
    if lora is not None:
        check_lora_sync(cfg)
    incarnation = _incarnation(cfg, replica, rank)
    heartbeat = Heartbeat(cfg, replica, incarnation, rank)  # from before it joins until it closes
    try:
        group = connect(cfg, refit_rank=num_train + rank, num_train=num_train, device=torch.device(device),
                        replica=replica, incarnation=incarnation)
        leave = (lambda: announce(cfg, "leave", replica, incarnation)) if rank == 0 else None
        return EngineMember(group, storage, cfg, num_train=num_train, lora=lora, on_report=on_report,
                            relay=relay_links(cfg, torch.device(device), replica, rank), heartbeat=heartbeat,
                            on_close=leave)
    except BaseException:
        heartbeat.close()
        raise


def relay_links(cfg: RefitConfig, device: torch.device, replica: int, rank: int):
    """An engine rank's links to rank ``rank`` of other replicas (the same pieces) (``refit.fanout``), joined
    when a route first needs them: 2-rank groups in the train ranks' store (NCCL between GPUs,
    gloo on CPU)."""
    from megatron_refit.endpoint.relay import RelayLinks

    backend = "nccl" if device.type == "cuda" else "gloo"

    def join(name: str, rank: int):
        return ProcessGroupTransport.connect(host=cfg.host, port=cfg.port, rank=rank, world_size=2, backend=backend,
                                             timeout_s=relay_wait_s(cfg), namespace=name)

    return RelayLinks(join, replica=replica, tp_rank=rank)


def _incarnation(cfg: RefitConfig, replica: int, rank: int) -> str:
    """This engine replica's incarnation: a new id that its rank 0 leaves for each of its
    other ranks in the train ranks' store (each takes its own, once: a restarted replica's
    ranks never read their predecessor's), then announces (joining the fleet)."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore(cfg.host, cfg.port, is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=cfg.timeout_s))
    if rank == 0:
        incarnation = uuid.uuid4().hex[:12]
        for other in range(1, cfg.replica_size):
            store.set(f"{JOINS}/{replica}/tp{other}", incarnation)
        announce(cfg, "join", replica, incarnation)
        return incarnation
    key = f"{JOINS}/{replica}/tp{rank}"
    incarnation = store.get(key).decode()  # waits for rank 0
    store.delete_key(key)
    return incarnation
