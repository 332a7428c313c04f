"""The public entry points: the calls a training loop and an engine make, driven by the
``refit:`` section of the training config.

Train ranks (:func:`conversion.refit.trainer_refit` enumerates a Megatron model's local
shards, then calls :func:`trainer_refit_from_pieces`)::

    bridge_cfg, refit_cfg = load_training_yaml("train.yaml")      # refit: {enabled: true, ...}
    sync = trainer_refit(refit_cfg, bridge, model, hf_config, rank=rank, num_train=world)
    for step in ...:
        train_step(...)
        sync.refit(step)                                           # after every optimizer step

Generation ranks hold the engine's storage (vLLM, SGLang, HF: a
:class:`~megatron_refit.endpoint.storage.Storage`) and call
``engine_refit(refit_cfg, storage, gen_index=i, num_train=...)`` then ``receive(step)``.
Both sides build the same plan once (in the constructor) and move only the bytes each
generation rank needs. With LoRA adapters on the trainer, the first refit (and any refit
called with ``full=True``, e.g. after the engine dropped its weights) moves base weights
and adapters; the others move the adapters only. Train ranks compute the refit rank
layout: ``0..num_train-1`` train, then ``gen_tp * gen_dp`` generation ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_refit.config import RefitConfig
from megatron_refit.endpoint.receiver import Receiver
from megatron_refit.endpoint.report import RefitReport
from megatron_refit.endpoint.sender import Refitter
from megatron_refit.transport import open_transport, transport_name


def connect(cfg: RefitConfig, *, refit_rank: int, num_train: int, device: torch.device):
    """The refit group of this rank over ``refit.transport`` (``auto``: NCCL between GPUs,
    gloo on CPU; colocated: bucket bytes through shared buffers (CUDA IPC / shared memory),
    control messages over gloo)."""
    world = num_train + cfg.gen_tp * cfg.gen_dp
    if not 0 <= refit_rank < world:
        raise ValueError(f"refit rank {refit_rank} outside the refit world of {world} "
                         f"(num_train={num_train} + gen_tp*gen_dp={cfg.gen_tp * cfg.gen_dp})")
    name = transport_name(cfg.transport, colocated=cfg.mode == "colocated", device=device)
    return open_transport(name, host=cfg.host, port=cfg.port, rank=refit_rank, world_size=world,
                          timeout_s=cfg.timeout_s, num_train=num_train, device=device)


def _check_lora_sync(cfg: RefitConfig) -> None:
    if cfg.lora_sync == "merged":
        raise ValueError("refit.lora_sync 'merged' (trainer-side merge) is not implemented: use 'adapters' or "
                         "'auto' (adapters sent, merged by the engine's receiver) or 'full'")


def check_enabled(cfg: RefitConfig, num_train: int) -> None:
    if not cfg.enabled:
        raise ValueError("refit.enabled is false: set enabled: true in the refit section of the training config")
    if not isinstance(num_train, int) or num_train < 1:
        raise ValueError(f"num_train must be a positive int, got {num_train!r}")


class _Sync:
    """One or two prepared endpoints (all pieces; adapters only) that share a version."""

    full = adapters = None
    _version: int | None = None

    def _endpoint(self, full: bool):
        """All pieces on the first refit, when asked, or without adapters; else the adapters."""
        return self.full if full or self._version is None or self.adapters is None else self.adapters

    def is_full(self, full: bool = False) -> bool:
        """Whether the next refit, called with ``full``, moves everything (else adapters only)."""
        return self._endpoint(full) is self.full

    def _advance(self, version: int) -> None:
        self._version = version
        for endpoint in (self.full, self.adapters):
            if endpoint is not None:
                endpoint.version = version  # the next refit must advance past it on either plan

    def close(self) -> None:
        """Release the group (colocated: collective, the shared buffers too)."""
        self.group.close()


class TrainerRefit(_Sync):
    """Train side of the refit (one per train rank); see the module docstring."""

    def __init__(self, group, pieces: list, adapters: list, cfg: RefitConfig, *, num_train: int,
                 offloader=None, on_report: Callable[[dict], None] | None = None):
        kw = dict(num_train=num_train, num_gen=cfg.gen_tp * cfg.gen_dp, bucket_bytes=cfg.bucket_bytes,
                  direct_bytes=cfg.direct_bytes, verify=cfg.verify, on_report=on_report, delta=cfg.delta,
                  replica_size=cfg.gen_tp)
        self.group = group
        kw.update(check_finite=cfg.check_finite, on_replica_failure=cfg.on_replica_failure)
        self.full = Refitter(group, pieces + adapters, offloader=offloader, **kw)
        self.plan = self.full.prepare()
        self.adapters = None
        if adapters and cfg.lora_sync != "full":
            self.adapters = Refitter(group, adapters, offloader=offloader, **kw)
            self.adapters.prepare()

    def refit(self, version: int, *, full: bool = False) -> RefitReport:
        """Send this rank's pieces of refit ``version``. Collective over the refit group:
        every train and generation rank calls it with the same ``version`` and ``full``."""
        report = self._endpoint(full).refit(version)
        self._advance(version)
        return report


class EngineRefit(_Sync):
    """Generation side of the refit (one per generation rank)."""

    def __init__(self, group, storage, cfg: RefitConfig, *, num_train: int, lora: tuple[int, float] | None = None,
                 on_report: Callable[[dict], None] | None = None):
        kw = dict(num_train=num_train, num_gen=cfg.gen_tp * cfg.gen_dp, bucket_bytes=cfg.bucket_bytes,
                  direct_bytes=cfg.direct_bytes, verify=cfg.verify, on_report=on_report, delta=cfg.delta,
                  replica_size=cfg.gen_tp)
        self.group = group
        self.adapters = None
        if lora is not None:
            from megatron_refit.endpoint.lora import LoraReceiver

            merge = LoraReceiver(storage, rank=lora[0], alpha=lora[1])
            self.full = Receiver(group, merge.full(), **kw)
            self.plan = self.full.prepare()
            if cfg.lora_sync != "full":
                self.adapters = Receiver(group, merge.adapters(), **kw)
                self.adapters.prepare()
        else:
            self.full = Receiver(group, storage, **kw)
            self.plan = self.full.prepare()
        self._last = self.full

    def receive(self, version: int, *, full: bool = False) -> RefitReport:
        """Receive refit ``version`` into the engine (see :meth:`TrainerRefit.refit`)."""
        self._last = self._endpoint(full)
        report = self._last.receive(version)
        self._advance(version)
        return report

    @property
    def state(self) -> str:
        """``ready`` after a complete refit; ``stale`` (or ``updating``) otherwise."""
        return self._last.state


def trainer_refit_from_pieces(cfg: RefitConfig, pieces: list, adapters: list, *, rank: int, num_train: int,
                              device: str | torch.device = "cpu", offloader=None,
                              on_report: Callable[[dict], None] | None = None) -> TrainerRefit:
    """:func:`conversion.refit.trainer_refit` for pieces at hand (objects with ``spec`` and ``tensor()``: Bridge's
    local shards, or :class:`~megatron_refit.endpoint.sender.TensorPiece`)."""
    check_enabled(cfg, num_train)
    if not 0 <= rank < num_train:
        raise ValueError(f"train rank {rank} outside 0..{num_train - 1}")
    if adapters:
        _check_lora_sync(cfg)
    if cfg.trainer_quantize_fp8:
        if adapters:
            raise ValueError("refit.trainer_quantize_fp8 with LoRA adapters: adapters are sent in the training "
                             "dtype and merged on the engine; quantize after merging there instead")
        from megatron_refit.endpoint.fp8_pieces import quantize_pieces

        pieces = quantize_pieces(pieces)
    group = connect(cfg, refit_rank=rank, num_train=num_train, device=torch.device(device))
    return TrainerRefit(group, pieces, adapters, cfg, num_train=num_train, offloader=offloader, on_report=on_report)


def engine_refit(cfg: RefitConfig, storage, *, gen_index: int, num_train: int, device: str | torch.device = "cpu",
                 lora: tuple[int, float] | None = None,
                 on_report: Callable[[dict], None] | None = None) -> EngineRefit:
    """Join the refit group as generation rank ``gen_index`` (``0..gen_tp*gen_dp-1``) with a
    the engine's ``storage`` (``target_specs`` / ``buffer`` / ``finalize``) and build the plan.
    ``lora=(rank, alpha)``: the trainer sends LoRA adapters, merged here into the weights."""
    check_enabled(cfg, num_train)
    num_gen = cfg.gen_tp * cfg.gen_dp
    if not 0 <= gen_index < num_gen:
        raise ValueError(f"gen_index {gen_index} outside 0..{num_gen - 1} (gen_tp={cfg.gen_tp}, gen_dp={cfg.gen_dp})")
    if lora is not None:
        _check_lora_sync(cfg)
    group = connect(cfg, refit_rank=num_train + gen_index, num_train=num_train, device=torch.device(device))
    return EngineRefit(group, storage, cfg, num_train=num_train, lora=lora, on_report=on_report)
