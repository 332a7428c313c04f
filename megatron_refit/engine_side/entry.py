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
    """Join the refit as engine rank ``gen_index`` (replica ``gen_index // gen_tp``, its TP rank
    ``gen_index % gen_tp``) with the engine's ``storage`` (``target_specs`` / ``buffer`` /
    ``finalize``) and build the plan. The replicas ``0..gen_dp-1`` are those the trainer starts
    with; any other (or one that restarted) joins at the trainer's next refit and gets the
    current version in full. ``lora=(rank, alpha)``: the trainer sends LoRA adapters, merged
    here into the weights. ``close()`` leaves (the trainer drops the replica at its next refit)."""
    check_enabled(cfg, num_train)
    if not isinstance(gen_index, int) or gen_index < 0:
        raise ValueError(f"gen_index must be a non-negative int, got {gen_index!r}")
    replica, tp_rank = divmod(gen_index, cfg.gen_tp)
    if lora is not None:
        check_lora_sync(cfg)
    incarnation = _incarnation(cfg, replica, tp_rank)
    heartbeat = Heartbeat(cfg, replica, incarnation, tp_rank)  # from before it joins until it closes
    try:
        group = connect(cfg, refit_rank=num_train + tp_rank, num_train=num_train, device=torch.device(device),
                        replica=replica, incarnation=incarnation)
        member = EngineMember(group, storage, cfg, num_train=num_train, lora=lora,
                              on_report=on_report, relay=relay_links(cfg, torch.device(device), replica, tp_rank))
    except BaseException:
        heartbeat.close()
        raise
    member.heartbeat = heartbeat
    if tp_rank == 0:
        member.on_close = lambda: announce(cfg, "leave", replica, incarnation)
    return member


def relay_links(cfg: RefitConfig, device: torch.device, replica: int, tp_rank: int):
    """An engine rank's links to TP rank ``tp_rank`` of other replicas (``refit.fanout``), joined
    when a route first needs them: 2-rank groups in the train ranks' store (NCCL between GPUs,
    gloo on CPU)."""
    from megatron_refit.endpoint.relay import RelayLinks

    backend = "nccl" if device.type == "cuda" else "gloo"

    def join(name: str, rank: int):
        return ProcessGroupTransport.connect(host=cfg.host, port=cfg.port, rank=rank, world_size=2, backend=backend,
                                             timeout_s=relay_wait_s(cfg), namespace=name)

    return RelayLinks(join, replica=replica, tp_rank=tp_rank)


def _incarnation(cfg: RefitConfig, replica: int, tp_rank: int) -> str:
    """This engine replica's incarnation: a new id that its TP rank 0 leaves for each of its
    other TP ranks in the train ranks' store (each takes its own, once: a restarted replica's
    ranks never read their predecessor's), then announces (joining the fleet)."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore(cfg.host, cfg.port, is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=cfg.timeout_s))
    if tp_rank == 0:
        incarnation = uuid.uuid4().hex[:12]
        for other in range(1, cfg.gen_tp):
            store.set(f"{JOINS}/{replica}/tp{other}", incarnation)
        announce(cfg, "join", replica, incarnation)
        return incarnation
    key = f"{JOINS}/{replica}/tp{tp_rank}"
    incarnation = store.get(key).decode()  # waits for TP rank 0
    store.delete_key(key)
    return incarnation
