"""Receivers over a live engine's model (vLLM, SGLang): pieces unpack in place into the
engine's own parameters, then the engine's post-load step runs.

Both engines store a layer's projections fused the same way (``qkv_proj``,
``gate_up_proj``, FusedMoE ``w13_weight`` / ``w2_weight``), so the layout of
:mod:`megatron_refit.engines.fused.layout` applies to both; only parameter-name spellings and the
post-load hook differ (SGLang's: :func:`megatron_refit.engines.sglang.worker.loader.sglang_post_load`).
Parameters are updated with ``copy_`` into existing storage: replacing ``Parameter``
objects would break CUDA-graph pointers and lose ``weight_loader`` attributes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_refit import families
from megatron_refit.engines.fused.layout import FusedLayoutStorage, RankLayout, fused_layout
from megatron_refit.errors import RepackedParameterError
from megatron_refit.plan.expert_placement import ExpertPlacement
from megatron_refit.plan.gen_layout import GenLayout, ModelShape
from megatron_refit.plan.spec import ShardSpec


def resolve_names(layout_names, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The engine parameter for each layout name (under the spellings the family tables list,
    first match wins); ``ValueError`` naming what is missing."""
    out, missing = {}, []
    for name in layout_names:
        candidates = [name]
        for suffix, spellings in families.engine_aliases():
            if name.endswith(suffix):
                candidates = [name.removesuffix(suffix) + s for s in spellings]
        found = next((c for c in candidates if c in params), None)
        if found is None:
            missing.append(name)
        else:
            out[name] = params[found].data
    if missing:
        raise ValueError(
            f"the engine model has no parameter for {missing[:5]} ({len(missing)} in all); "
            f"it has e.g. {sorted(params)[:5]}"
        )
    return out


class LiveModelStorage(FusedLayoutStorage):
    """Storage over an engine model's parameters on one generation TP rank.

    The engine may re-allocate its parameters between refits (vLLM's reload or sleep/wake,
    an offload, ``model.to(...)``): :meth:`refresh_targets`, called at the start of every
    refit, re-resolves the views when the storage moved and refuses, naming the parameter,
    when a parameter no longer has the checkpoint layout this receiver writes."""

    def __init__(self, model: torch.nn.Module, pieces: list[ShardSpec], model_shape: ModelShape, tp: int,
                 post_load: Callable[[], None] | None = None, slots=None,
                 pending: Callable[[str], bool] | None = None, *, source: RankLayout | None = None,
                 live_map: Callable[[], ExpertPlacement] | None = None):
        shapes, placements = fused_layout(pieces, model_shape, tp, slots)
        self.model = model
        self._shapes = shapes
        self._post_load = post_load
        self._pending = pending
        """Names the engine hands over after construction (vLLM's draft: its first draft
        session): meta placeholders until then; a refit that starts without them is refused."""
        self.holds_sent_bytes = False
        """An engine's post-load step may transform its parameters in place (quantize, repack):
        no delta refits unless the caller knows they stay as written and sets this True."""
        self.rebinds = 0
        """How often :meth:`refresh_targets` found the engine's storage moved and re-resolved it."""
        super().__init__(self._live_storage(when="at construction", placeholders=True), pieces, placements, slots,
                         source=source, live_map=live_map)

    def _live_storage(self, when: str, placeholders: bool = False) -> dict[str, torch.Tensor]:
        params = dict(self.model.named_parameters())
        if placeholders and self._pending is not None:
            params.update({name: torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
                           for name, (shape, dtype) in self._shapes.items()
                           if self._pending(name) and name not in params})
        storage = resolve_names(self._shapes, params)
        for name, (shape, dtype) in self._shapes.items():
            have = storage[name]
            if str(have.dtype).removeprefix("torch.") != dtype:
                handed = not placeholders and self._pending is not None and self._pending(name)
                raise ValueError(f"engine parameter {name} is {have.dtype} "
                                 f"{'as the engine handed it over (a draft)' if handed else when}, the trainer "
                                 f"sends {dtype}")
            if tuple(have.shape) != tuple(shape):
                raise RepackedParameterError(
                    f"engine parameter {name} has shape {tuple(have.shape)} {when}, the checkpoint layout needs "
                    f"{tuple(shape)}: the engine holds it in another format (e.g. repacked by a post-load step), "
                    "which a refit cannot write in place: use refit.engine_load: load_weights (or auto)"
                )
        return storage

    @classmethod
    def for_model(cls, model, hf_params: dict[str, tuple[tuple[int, ...], str]], layout: GenLayout,
                  model_shape: ModelShape, *, gen_index: int, post_load: Callable[[], None] | None = None,
                  pending: Callable[[str], bool] | None = None, live_map: Callable[[], ExpertPlacement] | None = None):
        """``live_map``: the engine's current expert map, read at the start of every refit (its load
        balancer moves experts while serving: :meth:`~.layout.FusedLayoutStorage.refresh_experts`)."""
        source = RankLayout(hf_params, layout, model_shape, gen_index)
        pieces, slots, _, _ = source.build()
        return cls(model, pieces, model_shape, layout.tp, post_load, slots=slots, pending=pending, source=source,
                   live_map=live_map)

    def refresh_targets(self) -> bool:
        """Before a refit: True (and views re-resolved) if the engine re-allocated any
        parameter since the last check; ``ValueError`` naming it if it changed shape or dtype."""
        live = self._live_storage(when="now (it changed since prepare())")
        if all(live[n].data_ptr() == t.data_ptr() and live[n].stride() == t.stride() for n, t in self._storage.items()):
            return False
        self._bind(live)
        self.rebinds += 1
        return True

    def finalize(self) -> None:
        super().finalize()  # parameters kept transformed (e.g. Mamba's A = -exp(A_log))
        if self._post_load is not None:
            self._post_load()


def vllm_post_load(model, model_config, device) -> Callable[[], None]:
    """vLLM's post-load step (``process_weights_after_loading``) for ``model``."""

    def run() -> None:
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        process_weights_after_loading(model, model_config, device)

    return run

