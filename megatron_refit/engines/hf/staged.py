"""Zero-downtime refits (``refit.swap: staged``) into a Hugging Face transformers engine.

:class:`StagedHFStorage` keeps a shadow copy of the model's tensors. A refit streams into
the shadow while the model keeps serving the live version; at the end of the refit the swap
exchanges the storage of every parameter (``param.data``: a pointer swap, no copy) under the
engine's :attr:`~megatron_refit.endpoint.storage.WeightsState.serving` lock, which every
forward pass holds, so no forward pass ever sees two versions, and the engine serves the new
version from the next pass on, tagged with it. Then, with the engine serving again, the
shadow (the old live tensors) takes a copy of the new version: a delta refit starts from it.

A failed refit leaves the live version serving (``ready``): only the shadow was written.
Memory: one more copy of the model, or ``budget_bytes`` (``refit.swap_budget_mb``): then
only the tensors that fit (in the model's order: embedding and the first layers) have a
shadow, and the refit writes the others in place under the pause, which then starts when
the first of them is about to be written and lasts to the swap. An engine whose parameters must not move (CUDA graphs)
copies the staging into its parameters under the pause instead: vLLM's ``load_weights``
engine load does (docs/guide-engines.md).
"""

from __future__ import annotations

import time

import torch

from megatron_refit.endpoint.fp8 import dequantize_blockwise
from megatron_refit.engines.hf.storage import HFStorage
from megatron_refit.plan.fp8_layout import scale_name


class StagedHFStorage(HFStorage):
    """An :class:`HFStorage` that takes refits into a shadow and swaps (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, *, fp8: bool = False, budget_bytes: int | None = None,
                 draft: torch.nn.Module | None = None):
        super().__init__(model, fp8=fp8, draft=draft)
        self.live_buffers = False  # a refit writes the shadow, swapped in after
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"staged swap budget must be a non-negative number of bytes, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self._live = self._tensors()
        self._shadow = self._new_shadow()
        self._shadow_views = self._views_of(self._shadow)
        self._updating = False
        self._paused_at: float | None = None
        """Partial budget: when this refit took the engine to write unshadowed tensors in place."""
        self._ptrs = self._pointers()
        self._next: int | None = None
        self.last_pause_s = 0.0
        """Seconds the last swap held the engine (no forward pass could run)."""
        self.swaps = 0

    def _tensors(self) -> dict[str, torch.Tensor]:
        """The model's (and its draft's) parameters and persistent buffers by state-dict name, each
        tensor once (a tied ``lm_head`` is the embedding): a swap moves the draft with the model."""
        out, seen = {}, set()
        for name, t in self.tensors_by_name().items():
            if id(t) not in seen:
                seen.add(id(t))
                out[name] = t
        return out

    def _new_shadow(self) -> dict[str, torch.Tensor]:
        """Copies of the live tensors, as many as the budget holds, in the model's order."""
        out, left = {}, self.budget_bytes
        for key, t in self._live.items():
            nbytes = t.numel() * t.element_size()
            if left is not None and nbytes > left:
                continue
            out[key] = t.detach().clone()
            left = None if left is None else left - nbytes
        return out

    @property
    def shadow_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._shadow.values())

    def _views_of(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The targets' views into ``tensors`` (the shadowed ones: a partial budget has fewer)."""
        return {name: view for name, view in self._live_views(tensors).items() if name in self._views}

    def buffer(self, name: str) -> torch.Tensor:
        if name in self._staged:
            return self._staged[name]
        view = self._shadow_views.get(name)
        if view is not None:
            return view
        if self._updating and self._paused_at is None:  # about to write served weights: pause serving
            self.serving.acquire()
            self._paused_at = time.perf_counter()
        return self._views[name]

    def refresh_targets(self) -> bool:
        """True (and the shadow rebuilt from the live model) if the model's tensors are no
        longer the ones this receiver swaps (re-allocated by ``model.to(...)``, say)."""
        live = self._tensors()
        if live.keys() == self._live.keys() and all(live[k] is self._live[k] for k in live) and \
                self._pointers() == self._ptrs:
            return False
        super().refresh_targets()  # refuses a changed shape or dtype by name
        self._live = live
        self._shadow = self._new_shadow()
        self._shadow_views = self._views_of(self._shadow)
        self._ptrs = self._pointers()
        return True

    def _pointers(self) -> dict[str, int]:
        return {key: t.data_ptr() for key, t in self._live.items()}

    def expect_version(self, version: int) -> None:
        self._next = version

    def set_state(self, state: str, version: int | None) -> None:
        # The live weights change only at the swap (which sets "ready" and the new version):
        # "updating" and a failed refit's "stale" concern the shadow, not what is served,
        # unless this refit already wrote served tensors (a partial budget) under the pause.
        self._updating = state == "updating"
        if self._paused_at is not None and state != "updating":
            self.state, self.weights_version = state, version  # we hold the pause
            self.went_live()
            self._paused_at = None
            self.serving.release()
            return
        if state == "ready" or self.weights_version is None and state != "updating":
            super().set_state(state, version)

    @torch.no_grad()
    def finalize(self) -> None:
        for name in self._staged:  # FP8 mode: dequantized into the shadow before the swap
            if name in self._shadow_views:
                view = self._shadow_views[name]
                view.copy_(dequantize_blockwise(self._staged[name], self._staged[scale_name(name)], dtype=view.dtype))
        paused = self._paused_at is not None
        if not paused:
            self.serving.acquire()
        start = self._paused_at if paused else time.perf_counter()
        try:
            for key in self._shadow:
                live = self._live[key]
                live.data, self._shadow[key] = self._shadow[key], live.data
            self._views = self._live_views()
            self.state, self.weights_version = "ready", self._next
            self.last_pause_s = time.perf_counter() - start
        finally:
            self._paused_at = None
            self.serving.release()
        self.swaps += 1
        self._ptrs = self._pointers()
        self._shadow_views = self._views_of(self._shadow)
        for key, shadow in self._shadow.items():  # the shadow takes the new version (serving meanwhile)
            shadow.copy_(self._live[key].data)
