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
:func:`megatron_refit.engine_side.entry.engine_refit` ``(refit_cfg, storage, gen_index=i,
num_train=...)`` then ``receive(step)`` (the engine's side imports nothing of this module's).
Both sides build the same plan once (in the constructor) and move only the bytes each
generation rank needs. With LoRA adapters on the trainer, the first refit (and any refit
called with ``full=True``, e.g. after the engine dropped its weights) moves base weights
and adapters; the others move the adapters only. Each engine replica has a refit group of its
own (the train ranks, then its ``gen_tp`` ranks) and a failure of one replica stays with it
(:mod:`megatron_refit.fleet.trainer_fleet`); replicas may join and leave between refits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_refit.config import RefitConfig
from megatron_refit.endpoint.sender import check_pieces
from megatron_refit.fleet.control import EngineControl
from megatron_refit.fleet.member import TrainerMember
from megatron_refit.fleet.trainer_fleet import TrainerFleet
from megatron_refit.group.connect import check_enabled, check_lora_sync, connect
from megatron_refit.transport import ProcessGroupTransport


CONTROL_TIMEOUTS = 3
"""The train ranks' control group waits this many ``refit.timeout_s``."""


def trainer_refit_from_pieces(cfg: RefitConfig, pieces: list, adapters: list, *, rank: int, num_train: int,
                              device: str | torch.device = "cpu", offloader=None,
                              on_report: Callable[[dict], None] | None = None, forward=None,
                              control: EngineControl | None = None) -> TrainerFleet:
    """:func:`conversion.refit.trainer_refit` for pieces at hand (:class:`~megatron_refit.endpoint.sender.HasPiece`:
    Bridge's local shards, or :class:`~megatron_refit.endpoint.sender.TensorPiece`). ``forward``: the trainer
    model's forward over the serving probe (:class:`~megatron_refit.fleet.serving.TrainerForward`,
    ``refit.verify_serving``; None: the trainer has none, its refits are not checked). ``control``:
    the engine's control plane over its clients (:func:`~megatron_refit.engines.control.engine_control`),
    which the fleet drives on train rank 0: each replica's connect, its calls around each replica's
    part of every refit, and the engines' close."""
    check_enabled(cfg, num_train)
    if not 0 <= rank < num_train:
        raise ValueError(f"train rank {rank} outside 0..{num_train - 1}")
    if adapters:
        check_lora_sync(cfg)
    check_pieces([*pieces, *adapters])  # named here, before a snapshot or FP8 reads a member
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

        pieces = quantize_pieces(pieces, draft=cfg.gen_draft)  # an engine's draft takes the MTP layers in FP8
    device = torch.device(device)
    # a replica that stalls holds each train rank's thread for it up to refit.timeout_s, at
    # different times on different train ranks: the train ranks' own group waits longer
    control_group = ProcessGroupTransport.connect(host=cfg.host, port=cfg.port, rank=rank, world_size=num_train,
                                                  backend="gloo", timeout_s=CONTROL_TIMEOUTS * cfg.timeout_s)
    plans: dict = {}  # one plan per replica layout, whatever the number of replicas

    def member(group) -> TrainerMember:
        return TrainerMember(group, pieces, adapters, cfg, num_train=num_train, plans=plans)

    def join(replica: int, incarnation: str):
        return connect(cfg, refit_rank=rank, num_train=num_train, device=device, replica=replica,
                       incarnation=incarnation)

    return TrainerFleet(cfg, control_group, connect=join, member=member, offloader=offloader, on_report=on_report,
                        background=_background(cfg, snapshot, rank=rank, num_train=num_train), forward=forward,
                        control=control)


def _background(cfg: RefitConfig, snapshot, *, rank: int, num_train: int):
    """``refit.overlap: on``: what builds the background sender of this train rank over the
    fleet's runner (with, under ``overlap_busy: skip``, a skip group of the train ranks that
    agrees on each skip)."""
    if snapshot is None:
        return None
    from megatron_refit.fleet.overlap import BackgroundRefit

    skip_group = None
    if cfg.overlap_busy == "skip":
        skip_group = ProcessGroupTransport.connect(host=cfg.host, port=cfg.port, rank=rank, world_size=num_train,
                                                   backend="gloo", timeout_s=CONTROL_TIMEOUTS * cfg.timeout_s,
                                                   namespace="megatron_refit/overlap")
    return lambda runner: BackgroundRefit(snapshot, runner, busy=cfg.overlap_busy, skip_group=skip_group)
