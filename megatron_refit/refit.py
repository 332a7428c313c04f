"""The public entry points: the calls a training loop and an engine make, driven by the
``refit:`` section of the training config.

Train ranks (:func:`conversion.refit.trainer_refit` enumerates a Megatron model's local
shards, then calls :func:`trainer_refit_from_pieces`)::

    bridge_cfg, refit_cfg = load_training_yaml("train.yaml")      # refit: {enabled: true, ...}
    fleet = trainer_refit(refit_cfg, bridge, model, hf_config, rank=rank, num_train=world)
    for step in ...:
        train_step(...)
        fleet.refit(step)                                          # after every optimizer step

Generation ranks hold the engine's storage (vLLM, SGLang, HF: a
:class:`~megatron_refit.endpoint.storage.Storage`) and call
``engine_refit(refit_cfg, storage, gen_index=i, num_train=...)`` then ``receive(step)``.
Both sides build the same plan once (in the constructor) and move only the bytes each
generation rank needs. With LoRA adapters on the trainer, the first refit (and any refit
called with ``full=True``, e.g. after the engine dropped its weights) moves base weights
and adapters; the others move the adapters only. Each engine replica has a refit group of its
own (the train ranks, then its ``gen_tp`` ranks) and a failure of one replica stays with it
(:mod:`megatron_refit.fleet.trainer_fleet`); replicas may join and leave between refits.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import torch

from megatron_refit.config import RefitConfig
from megatron_refit.fleet.member import member_config
from megatron_refit.fleet.trainer_fleet import TrainerFleet
from megatron_refit.fleet.heartbeat import Heartbeat, stall_s
from megatron_refit.fleet.store import JOINS, announce, namespace
from megatron_refit.fleet.member import EngineMember, TrainerMember
from megatron_refit.transport import ProcessGroupTransport, open_transport, transport_name


CONTROL_TIMEOUTS = 3
"""The train ranks' control group waits this many ``refit.timeout_s``."""


def connect(cfg: RefitConfig, *, refit_rank: int, num_train: int, device: torch.device, replica: int,
            incarnation: str):
    """This rank's end of engine replica ``replica``'s refit group (the train ranks and that
    replica's ``gen_tp`` ranks, in the train ranks' store at ``refit.port`` under the
    replica's incarnation: :func:`~megatron_refit.fleet.store.namespace`) over ``refit.transport``
    (``auto``: NCCL between GPUs, gloo on CPU; colocated: bucket bytes through shared buffers
    (CUDA IPC / shared memory), control messages over gloo)."""
    world = num_train + cfg.gen_tp
    if not 0 <= refit_rank < world:
        raise ValueError(f"refit rank {refit_rank} outside a replica's refit group of {world} "
                         f"(num_train={num_train} + gen_tp={cfg.gen_tp})")
    name = transport_name(cfg.transport, colocated=cfg.mode == "colocated", device=device)
    return open_transport(name, host=cfg.host, port=cfg.port, rank=refit_rank, world_size=world,
                          timeout_s=cfg.timeout_s, num_train=num_train, device=device,
                          namespace=namespace(replica, incarnation))


def _check_lora_sync(cfg: RefitConfig) -> None:
    if cfg.lora_sync == "merged":
        raise ValueError("refit.lora_sync 'merged' (trainer-side merge) is not implemented: use 'adapters' or "
                         "'auto' (adapters sent, merged by the engine's receiver) or 'full'")


def check_enabled(cfg: RefitConfig, num_train: int) -> None:
    if not cfg.enabled:
        raise ValueError("refit.enabled is false: set enabled: true in the refit section of the training config")
    if not isinstance(num_train, int) or num_train < 1:
        raise ValueError(f"num_train must be a positive int, got {num_train!r}")


def trainer_refit_from_pieces(cfg: RefitConfig, pieces: list, adapters: list, *, rank: int, num_train: int,
                              device: str | torch.device = "cpu", offloader=None,
                              on_report: Callable[[dict], None] | None = None, forward=None) -> TrainerFleet:
    """:func:`conversion.refit.trainer_refit` for pieces at hand (objects with ``spec`` and ``tensor()``: Bridge's
    local shards, or :class:`~megatron_refit.endpoint.sender.TensorPiece`). ``forward``: the trainer
    model's forward over the serving probe (:class:`~megatron_refit.fleet.serving.TrainerForward`,
    ``refit.verify_serving``; None: the trainer has none, its refits are not checked)."""
    check_enabled(cfg, num_train)
    if not 0 <= rank < num_train:
        raise ValueError(f"train rank {rank} outside 0..{num_train - 1}")
    if adapters:
        _check_lora_sync(cfg)
    snapshot = None
    if cfg.overlap == "on":
        if offloader is not None:
            raise ValueError("refit.overlap: on with a ParamOffloader: offloaded parameters are not trained while "
                             "they are away, so there is no next step to overlap; set refit.overlap: off")
        from megatron_refit.fleet.overlap import Snapshot

        snapshot = Snapshot(list(pieces) + list(adapters))  # the members send from it; FP8 quantizes from it
        pieces, adapters = snapshot.pieces[:len(pieces)], snapshot.pieces[len(pieces):]
    if cfg.trainer_quantize_fp8:
        if adapters:
            raise ValueError("refit.trainer_quantize_fp8 with LoRA adapters: adapters are sent in the training "
                             "dtype and merged on the engine; quantize after merging there instead")
        from megatron_refit.endpoint.fp8_pieces import quantize_pieces

        pieces = quantize_pieces(pieces)
    device = torch.device(device)
    # a replica that stalls holds each train rank's thread for it up to refit.timeout_s, at
    # different times on different train ranks: the train ranks' own group waits longer
    control = ProcessGroupTransport.connect(host=cfg.host, port=cfg.port, rank=rank, world_size=num_train,
                                            backend="gloo", timeout_s=CONTROL_TIMEOUTS * cfg.timeout_s)
    member_cfg = member_config(cfg)
    plans: dict = {}  # one plan per replica layout, whatever the number of replicas

    def member(group) -> TrainerMember:
        return TrainerMember(group, pieces, adapters, member_cfg, num_train=num_train, plans=plans)

    def join(replica: int, incarnation: str):
        return connect(cfg, refit_rank=rank, num_train=num_train, device=device, replica=replica,
                       incarnation=incarnation)

    return TrainerFleet(cfg, control, connect=join, member=member, offloader=offloader, on_report=on_report,
                        background=_background(cfg, snapshot, rank=rank, num_train=num_train), forward=forward)


def _background(cfg: RefitConfig, snapshot, *, rank: int, num_train: int):
    """``refit.overlap: on``: the background sender of this train rank (with, under
    ``overlap_busy: skip``, a gate group of the train ranks that agrees on each skip)."""
    if snapshot is None:
        return None
    from megatron_refit.fleet.overlap import BackgroundRefit

    gate = None
    if cfg.overlap_busy == "skip":
        gate = ProcessGroupTransport.connect(host=cfg.host, port=cfg.port, rank=rank, world_size=num_train,
                                             backend="gloo", timeout_s=CONTROL_TIMEOUTS * cfg.timeout_s,
                                             namespace="megatron_refit/overlap")
    return BackgroundRefit(snapshot, busy=cfg.overlap_busy, gate=gate)


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
        _check_lora_sync(cfg)
    incarnation = _incarnation(cfg, replica, tp_rank)
    heartbeat = Heartbeat(cfg, replica, incarnation, tp_rank)  # from before it joins until it closes
    try:
        group = connect(cfg, refit_rank=num_train + tp_rank, num_train=num_train, device=torch.device(device),
                        replica=replica, incarnation=incarnation)
        member = EngineMember(group, storage, member_config(cfg), num_train=num_train, lora=lora,
                              on_report=on_report, relay=relay_links(cfg, torch.device(device), replica, tp_rank))
    except BaseException:
        heartbeat.close()
        raise
    member.heartbeat = heartbeat
    if tp_rank == 0:
        member.on_close = lambda: announce(cfg, "leave", replica, incarnation)
    return member


def relay_wait_s(cfg: RefitConfig) -> float:
    """``refit.fanout``: the bound of every wait on a relay link (joining it, a bucket forwarded or
    awaited): ``refit.stall_s`` where it is on (a relay or successor that stops is given up on as
    soon as the train ranks would call it stalled), else ``refit.timeout_s``."""
    return stall_s(cfg) or cfg.timeout_s


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
