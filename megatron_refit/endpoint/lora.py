"""LoRA on the generation side: keep the base weights, receive only adapters afterwards.

What travels: the base weights once (first refit, or after the engine dropped its weights,
e.g. vLLM sleep level 2) and the LoRA adapters (``<hf name>.lora_A.weight [rank, in]``,
``.lora_B.weight [out, rank]``) at every refit — adapter bytes only, usually well under 1 %
of the model. Why adapters and not a merged delta: a dense delta ``B @ A`` has the size of
the weight itself, so sending it would save nothing over sending merged weights.

The engine computes with merged weights: after each refit every adapted weight becomes
``base + (alpha / rank) * (B @ A)``, in float32 and cast back — Megatron-Bridge's merge,
so the result equals Bridge's merged export. :class:`LoraStorage` does that over a
:class:`~megatron_refit.engines.hf.storage.HFStorage` (gen TP 1) and offers a receiver two
storages over one state: :meth:`full` (base + adapters) and :meth:`adapters`.
"""

from __future__ import annotations

import torch

from megatron_refit.endpoint.storage import RefreshesTargets, ReportsVersion, TracksState
from megatron_refit.plan.roles import is_adapted
from megatron_refit.plan.spec import ShardSpec


def lora_names(weight: str) -> tuple[str, str]:
    base = weight.removesuffix(".weight")
    return f"{base}.lora_A.weight", f"{base}.lora_B.weight"


class LoraStorage:
    """Base weights and adapters of a receiver's adapted projections; merges on finalize.

    ``hf``: any storage (``target_specs`` / ``buffer`` / ``finalize``): the HF
    receiver (whole tensors) or an engine's (a box of each weight per TP rank). For a weight
    piece with rows ``r`` and columns ``c`` of the HF tensor this rank receives ``lora_A``'s
    columns ``c`` and ``lora_B``'s rows ``r``, and merges ``base + scale * (B[r] @ A[:, c])``:
    each element is the same rank-long dot product as in Bridge's whole-tensor merge."""

    def __init__(self, hf, *, rank: int, alpha: float):
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise ValueError(f"LoRA rank must be a positive int, got {rank!r}")
        self.hf = hf
        self.scale = alpha / rank
        self.base: dict[str, torch.Tensor] = {}
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        self._specs: dict[str, ShardSpec] = {}
        self._adapter_boxes: dict[str, ShardSpec] = {}
        self.has_base = False
        """False until a full refit completed, and again after :meth:`drop_base`."""
        for spec in hf.target_specs():
            if len(spec.global_shape) == 2 and spec.name.endswith(".weight") and \
                    is_adapted(spec.name):
                out_dim, in_dim = spec.global_shape
                (r0, r1), (c0, c1) = spec.box
                dtype = getattr(torch, spec.dtype)
                device = hf.buffer(spec.name).device
                self.base[spec.name] = torch.empty(spec.shape, dtype=dtype, device=device)
                a, b = lora_names(spec.name)
                self.a[a] = torch.empty(rank, c1 - c0, dtype=dtype, device=device)
                self.b[b] = torch.empty(r1 - r0, rank, dtype=dtype, device=device)
                self._adapter_boxes[a] = ShardSpec(name=a, global_shape=(rank, in_dim), dtype=spec.dtype,
                                                   box=((0, rank), (c0, c1)))
                self._adapter_boxes[b] = ShardSpec(name=b, global_shape=(out_dim, rank), dtype=spec.dtype,
                                                   box=((r0, r1), (0, rank)))
            self._specs[spec.name] = spec
        if not self.base:
            raise ValueError("the model has no projection that LoRA adapts")

    def _adapter_specs(self) -> list[ShardSpec]:
        return list(self._adapter_boxes.values())

    def full(self) -> _RefitView:
        """The storage a refit that moves everything (base weights and adapters) lands in."""
        return _RefitView(self, list(self._specs.values()) + self._adapter_specs(), full=True)

    def adapters(self) -> _RefitView:
        """The storage a refit that moves only the adapters (the base is kept) lands in."""
        return _RefitView(self, self._adapter_specs(), full=False)

    def drop_base(self) -> None:
        """The engine released its weights (e.g. vLLM sleep level 2): the next refit must be full."""
        self.has_base = False

    def buffer(self, name: str) -> torch.Tensor:
        for store in (self.base, self.a, self.b):
            if name in store:
                return store[name]
        return self.hf.buffer(name)

    @torch.no_grad()
    def merge(self) -> None:
        """Every adapted weight := base + scale * (B @ A), in float32 (Bridge's merge)."""
        for name, base in self.base.items():
            a, b = lora_names(name)
            merged = base.float() + self.scale * (self.b[b].float() @ self.a[a].float())
            self.hf.buffer(name).copy_(merged.to(base.dtype))


class _RefitView:
    """One refit's view of a :class:`LoraStorage` (a storage: what it lands, how it finishes)."""

    def __init__(self, lora: LoraStorage, specs: list[ShardSpec], *, full: bool):
        self.lora, self.specs, self.full = lora, specs, full

    def target_specs(self) -> list[ShardSpec]:
        return list(self.specs)

    def buffer(self, name: str) -> torch.Tensor:
        return self.lora.buffer(name)

    def finalize(self) -> None:
        if not self.full and not self.lora.has_base:
            raise RuntimeError("LoRA adapters arrived but this engine holds no base weights (never received, or "
                               "dropped): the trainer must run a full refit")
        self.lora.merge()  # before the engine's own post-load (e.g. a load_weights engine loads merged weights)
        self.lora.hf.finalize()
        self.lora.has_base = True

    def set_state(self, state: str, version: int | None) -> None:
        if isinstance(self.lora.hf, TracksState):
            self.lora.hf.set_state(state, version)

    def refresh_targets(self) -> bool:
        return bool(self.lora.hf.refresh_targets()) if isinstance(self.lora.hf, RefreshesTargets) else False

    holds_sent_bytes = True
    """Base and adapter pieces are kept as received (merging writes the HF model's weights)."""

    @property
    def weights_version(self) -> int | None:
        """The engine's version, while it holds base weights (a delta starts from them)."""
        held = self.lora.hf.weights_version if isinstance(self.lora.hf, ReportsVersion) else None
        return held if self.lora.has_base else None
