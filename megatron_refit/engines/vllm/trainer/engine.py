"""The trainer side of the ``megatron_refit`` vLLM weight-transfer backend.

vLLM's contract (``TrainerWeightTransferEngine``): ``trainer_init(init_info, client=...,
source=...)`` and ``send_weights()`` are called on **every** train rank; rank 0 drives the
engines' control plane through ``client`` (``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights``, ``finish_weight_update``), one engine per replica,
through :class:`~megatron_refit.engines.vllm.trainer.control.VllmControl` (each replica's calls in
its own lane), which the fleet drives. Unlike vLLM's own backends, where rank 0 is the only sender,
every train rank here sends its own local shards straight to the engine ranks that need them;
each engine's blocking ``update_weights`` call runs in its lane while all train ranks send, as
vLLM's NCCL backend does.

``LocalShardSource`` is the ``WeightSource``: a train rank's HF-named local shards (Bridge's
conversion tasks, no gather). Shard boxes of fused QKV heads, gated MLP halves, padded
vocabularies and expert slices are not ``Shard``/``Replicate`` placements, so it offers
neither ``iter_full`` (a gather) nor ``iter_local``: vLLM's own engines refuse it with their
own error, and this engine reads its pieces.

This module imports without vLLM: Megatron training environments often lack it (its
transformers pins differ). With vLLM importable, the classes derive from vLLM's
(``TrainerInitInfo``, ``WeightSource``, ``TrainerWeightTransferEngine``) and the plugin
registers the engine in ``WeightTransferTrainerFactory``; without it they keep the same
methods, called directly (``MegatronRefitTrainerEngine.trainer_init``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar

import torch

from megatron_refit.config import RefitConfig, check_int, refit_section
from megatron_refit.endpoint.report import RefitReport
from megatron_refit.endpoint.sender import check_pieces
from megatron_refit.engines.vllm import BACKEND
from megatron_refit.engines.vllm.trainer.clients import ReplicaClients
from megatron_refit.engines.vllm.trainer.control import VllmControl
from megatron_refit.refit import trainer_refit_from_pieces

try:  # vLLM's trainer-side contract, where the trainer's environment has vLLM
    from vllm.distributed.weight_transfer.base import TrainerInitInfo as _InitInfoBase
    from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine
    from vllm.distributed.weight_transfer.base import WeightSource as _SourceBase

    HAVE_VLLM = True
except ImportError:  # the same methods without vLLM's base classes (see the module docstring)
    _InitInfoBase = _SourceBase = object
    HAVE_VLLM = False


@dataclass(kw_only=True)
class MegatronRefitTrainerInitInfo(_InitInfoBase):
    """``trainer_init`` argument (every train rank passes its own ``rank``; rank 0 drives the
    engine's control plane, every rank sends its shards)."""

    backend: ClassVar[str] = BACKEND

    refit: Any
    """The ``refit:`` section (a mapping or a ``RefitConfig``), as the engine gets it."""
    num_train: int
    """Train ranks that send (the trainer's world size)."""
    rank: int
    """This train rank (``0..num_train-1``)."""
    config: RefitConfig = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.config = refit_section(self.refit, "init_info")
        check_int("init_info.num_train", self.num_train, minimum=1)
        check_int("init_info.rank", self.rank, minimum=0)
        if self.rank >= self.num_train:
            raise ValueError(f"init_info.rank {self.rank} outside 0..{self.num_train - 1} (num_train={self.num_train})")

    @property
    def is_sender(self) -> bool:
        """Rank 0 drives the engine's control plane (every rank sends bytes)."""
        return self.rank == 0


class LocalShardSource(_SourceBase):
    """This train rank's local pieces (:class:`~megatron_refit.endpoint.sender.HasPiece`): weights and LoRA adapters."""

    def __init__(self, weights: list, adapters: list = (), *, lora_rank: int = 0, lora_alpha: float = 0.0,
                 device: str | torch.device | None = None, forward=None):
        self.weights = list(weights)
        check_pieces([*self.weights, *adapters])
        self.forward = forward
        """The trainer model's forward over the serving probe (``refit.verify_serving``; None: none)."""
        self.adapters = list(adapters)
        if self.adapters and lora_rank < 1:
            raise ValueError(f"LocalShardSource has {len(self.adapters)} LoRA adapter pieces but lora_rank "
                             f"{lora_rank!r}: pass the adapters' rank and alpha")
        self.lora_rank = lora_rank if self.adapters else 0
        self.lora_alpha = lora_alpha if self.adapters else 0.0
        if device is None and self.weights:
            device = self.weights[0].tensor().device
            self.weights[0].release()  # drop a copy tensor() made (a QKV split)
        self.device = torch.device(device or "cpu")

    @cached_property
    def metadata(self) -> list:
        """vLLM's ``ParamMeta`` of every HF parameter, with the train ranks that hold a piece of
        it (a collective over the trainer's default process group when there is one).
        Placements are left unset: see the module docstring. vLLM 0.33 reads it as a cached
        property, 0.32 calls it: the list answers both (``source.metadata()`` is itself)."""
        import dataclasses

        import torch.distributed as dist
        from vllm.distributed.weight_transfer.base import ParamMeta

        mine = sorted({(p.spec.name, p.spec.dtype, p.spec.global_shape) for p in self.weights + self.adapters})
        if dist.is_available() and dist.is_initialized():
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
        else:
            gathered = [mine]
        owners: dict[tuple, list[int]] = {}
        for rank, entries in enumerate(gathered):
            for entry in entries:
                owners.setdefault(entry, []).append(rank)
        with_owners = "owners" in {f.name for f in dataclasses.fields(ParamMeta)}  # vLLM 0.33 on
        return _Metadata(ParamMeta(name, getattr(torch, dtype), shape,
                                   **({"owners": tuple(ranks)} if with_owners else {}))
                         for (name, dtype, shape), ranks in sorted(owners.items()))

    def __iter__(self):
        """vLLM 0.32's full-tensor stream (abstract there): not offered, see the module docstring."""
        raise TypeError("LocalShardSource holds this train rank's local shards, not full tensors: only the "
                        "megatron_refit trainer engine reads it (vLLM's own backends need full tensors)")


class _Metadata(list):
    """``ParamMeta`` list that is also callable (vLLM 0.32's ``WeightSource.metadata()``)."""

    def __call__(self) -> list:
        return self


_EngineBase = TrainerWeightTransferEngine[MegatronRefitTrainerInitInfo] if HAVE_VLLM else object


class MegatronRefitTrainerEngine(_EngineBase):
    """vLLM trainer-side engine of the ``megatron_refit`` backend (see the module docstring)."""

    init_info_cls = MegatronRefitTrainerInitInfo

    def __init__(self, *, client, source: LocalShardSource, is_sender: bool, rank: int, fleet) -> None:
        # what vLLM's base __init__ sets, set here so that the class works without vLLM too
        self.client, self.source, self.is_sender, self.rank = client, source, is_sender, rank
        self.fleet = fleet
        """The :class:`~megatron_refit.fleet.trainer_fleet.TrainerFleet` of this rank (on rank 0 it
        drives the engines through a :class:`~megatron_refit.engines.vllm.trainer.control.VllmControl`)."""
        self.version: int | None = None

    @classmethod
    def trainer_init(cls, init_info: MegatronRefitTrainerInitInfo, *, client, source=None):
        """Join the refit group and build the plan with the engines; rank 0 initialises each
        engine's side through its client meanwhile (``client``: one ``VLLMWeightSyncClient``, or a
        :class:`~megatron_refit.engines.vllm.trainer.clients.ReplicaClients` over one engine per
        replica). Every train rank calls it."""
        if not isinstance(source, LocalShardSource):
            raise ValueError(f"the megatron_refit trainer engine sends local shards: pass a LocalShardSource "
                             f"(e.g. conversion.refit.local_shard_source(bridge, model, hf_config)), got "
                             f"{type(source).__name__}")
        cfg = init_info.config
        control = None
        if init_info.is_sender:
            clients = client.clients if isinstance(client, ReplicaClients) else [client]
            if len(clients) != cfg.gen_dp:
                raise ValueError(f"{len(clients)} vLLM engine client(s) for refit.gen_dp={cfg.gen_dp} replicas: pass "
                                 "one client per starting replica, e.g. ReplicaClients([...]) (engines that start "
                                 "later join through add_engine; a vLLM engine running its own data parallelism is "
                                 "not driven replica by replica: run one engine per replica)")
            control = VllmControl(clients, cfg, lora=(source.lora_rank, source.lora_alpha))

        fleet = trainer_refit_from_pieces(cfg, source.weights, source.adapters, rank=init_info.rank,
                                          num_train=init_info.num_train, device=source.device,
                                          forward=source.forward, control=control)
        fleet.await_start()  # every engine joined (or failed, named; none joined: raises)
        return cls(client=client, source=source, is_sender=init_info.is_sender, rank=init_info.rank, fleet=fleet)

    def send_weights(self, version: int | None = None, *, full: bool = False) -> RefitReport:
        """One refit: every train rank sends its pieces; rank 0 drives each engine's
        ``start_weight_update``, ``update_weights`` (concurrently with the sends) and
        ``finish_weight_update`` (with the version as vLLM's weight version). ``version``: the
        training step (default: one past the last); ``full``: resend base weights under LoRA
        adapter sync (e.g. after the engine slept at level 2). Every train rank calls it with
        the same arguments."""
        if version is None:
            version = 1 if self.version is None else self.version + 1
        report = self.fleet.refit(version, full=full)
        self.version = version
        return report

    def add_engine(self, client, *, replica: int | None = None) -> int:
        """Train rank 0, between refits: a new vLLM engine (``client``: its ``VLLMWeightSyncClient``)
        joins as replica ``replica`` (default: a new index; a dead replica's index to restart it).
        Its ``init_weight_transfer_engine`` runs now, against the running trainer, and the next
        ``send_weights`` sends it the current version in full, deltas afterwards; returns the
        replica's index."""
        if not self.is_sender:
            raise ValueError(f"add_engine: only train rank 0 takes in engines; this is train rank {self.rank}")
        return self.fleet.add(client, replica=replica)

    def shutdown(self) -> None:
        """Release the refit group; rank 0 also releases each engine's side
        (``shutdown_weight_transfer_engine``, where the client offers it)."""
        if self.fleet is None:
            return
        fleet, self.fleet = self.fleet, None
        fleet.close()
