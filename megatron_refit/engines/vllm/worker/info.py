"""The engine's side of what travels through vLLM's control plane (see :mod:`.payload`).

vLLM's ``parse_init_info`` / ``parse_update_info`` build these from the JSON payloads; a bad
one gets a ``ValueError`` naming the field before anything connects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo

from megatron_refit.config import RefitConfig, refit_section
from megatron_refit.config import check_int as _int


@dataclass(kw_only=True)
class MegatronRefitInitInfo(WeightTransferInitInfo):
    """``init_weight_transfer_engine`` payload of the worker engine."""

    refit: dict
    """The trainer's ``refit:`` section (rendezvous, engine layout, buckets, timeouts)."""
    num_train: int
    """Train ranks in the refit group (refit ranks ``0..num_train-1``)."""
    replica: int | None = None
    """This engine's replica index when the replicas are independent vLLM engines (one
    ``LLM`` or server each): a client that drives several sets it per engine. ``None``: vLLM's
    own data-parallel rank."""
    lora_rank: int = 0
    """LoRA rank when the trainer syncs adapters (0: no LoRA)."""
    lora_alpha: float = 0.0
    """LoRA alpha (merged weight = base + alpha / rank * B @ A)."""
    config: RefitConfig = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.config = refit_section(self.refit, "init_info")
        _int("init_info.num_train", self.num_train, minimum=1)
        if self.replica is not None:
            _int("init_info.replica", self.replica, minimum=0)
        _int("init_info.lora_rank", self.lora_rank, minimum=0)
        if isinstance(self.lora_alpha, bool) or not isinstance(self.lora_alpha, (int, float)):
            raise ValueError(f"init_info.lora_alpha must be a number, got {self.lora_alpha!r}")
        if self.lora_rank and self.lora_alpha <= 0:
            raise ValueError(f"init_info.lora_alpha must be positive with lora_rank {self.lora_rank}, "
                             f"got {self.lora_alpha!r}")


@dataclass(kw_only=True)
class MegatronRefitUpdateInfo(WeightTransferUpdateInfo):
    """``update_weights`` payload: one refit."""

    version: int
    """The refit version (the training step); it must advance at every refit."""
    full: bool = True
    """False for a LoRA adapter-only refit (the trainer decides, the engine follows)."""
    complete: bool = False
    """``swap: staged``: this call waits for the update's staging and its preparation beside the
    live model (started by the update's first call) and raises their error: an update that fails
    before its swap fails in ``update_weights``, which ends vLLM's update session, and no pause
    is taken for it."""

    def __post_init__(self) -> None:
        _int("update_info.version", self.version, minimum=0)
        for name in ("full", "complete"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"update_info.{name} must be true or false, got {getattr(self, name)!r}")
