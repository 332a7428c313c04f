"""vLLM's layerwise reload of unquantized fused-MoE layers, made to run the experts' post-load step
(engine process; ``engine_load: load_weights``).

vLLM's ``UnquantizedFusedMoEMethod`` treats every ``process_weights_after_loading`` after the first
as a weight update (its ``moe_kernel`` is built by then) and skips the experts' own post-load step
(``moe_kernel.fused_experts.process_weights_after_loading``): a weight update, it reasons, only
rewrites data in place. Where that step transforms the weights (on CPU ``cpu_moe.py`` prepacks the
experts into its grouped-GEMM layout) a reload leaves the kernel reading unpacked experts as
packed: every byte written is right, the served model is not (vLLM 0.32 and 0.33 alike; its own
``reload_weights`` serves the same wrong answers).

:class:`FirstLoadSetup` clears, around a reload, the kernel of every such layer (one whose
experts override the step), so that vLLM's own code takes its first-load path: it builds the
kernel from the reloaded weights and runs the experts' post-load step, as a fresh engine does. A
layer the reload did not process gets its kernel back. :func:`check_reloadable` refuses, at
``init_weight_transfer_engine``, an unquantized MoE method this module does not know how to set up
again (no ``moe_kernel``), naming it and what to do instead.
"""

from __future__ import annotations

import torch


def _unquantized_moe(module: torch.nn.Module):
    """The module's unquantized fused-MoE method, or None."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    method = getattr(module, "quant_method", None)
    return method if isinstance(method, UnquantizedFusedMoEMethod) else None


def _skips_on_update(method) -> bool:
    """Whether vLLM's weight-update path skips a post-load step this method's experts need."""
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts

    experts = getattr(method.moe_kernel, "fused_experts", None)
    own = getattr(type(experts), "process_weights_after_loading", None)
    return experts is not None and own is not FusedMoEExperts.process_weights_after_loading


def check_reloadable(model: torch.nn.Module) -> int:
    """``init_weight_transfer_engine`` in ``load_weights`` mode: the number of fused-MoE layers
    whose reload :class:`FirstLoadSetup` sets up again; ``ValueError`` naming a layer whose method
    it cannot (then a reload could serve unpacked experts)."""
    count = 0
    for name, module in model.named_modules():
        method = _unquantized_moe(module)
        if method is None:
            continue
        if not hasattr(method, "moe_kernel"):
            raise ValueError(f"vLLM layer {name}: its {type(method).__name__} has no moe_kernel, so megatron_refit "
                             "cannot make vLLM's reload run the experts' post-load step (on CPU: their prepack), "
                             "and the engine could serve other weights than it received: run a vLLM version "
                             "megatron_refit supports (0.32, 0.33), or engine_load: in_place where the engine "
                             "keeps the checkpoint layout (GPU)")
        count += method.moe_kernel is not None and _skips_on_update(method)
    return count


class FirstLoadSetup:
    """Around one layerwise reload (see the module docstring): ``with FirstLoadSetup(model): ...``."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self._saved: dict[int, tuple] = {}

    def __enter__(self) -> FirstLoadSetup:
        for module in self.model.modules():
            method = _unquantized_moe(module)
            if method is not None and method.moe_kernel is not None and _skips_on_update(method):
                self._saved[id(method)] = method, method.moe_kernel, getattr(method, "moe_quant_config", None)
                method.moe_kernel = None  # vLLM's own first-load path: kernel and experts set up again
        return self

    def __exit__(self, *exc) -> None:
        for method, kernel, quant_config in self._saved.values():
            if method.moe_kernel is None:  # not processed by this reload: its weights are the old ones
                method.moe_kernel, method.moe_quant_config = kernel, quant_config
        self._saved.clear()

    @property
    def layers(self) -> int:
        return len(self._saved)
