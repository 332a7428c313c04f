"""Family-specific steps of a CPU / meta-device build through Megatron-Bridge, as the family
tables (:mod:`megatron_refit.families`) name them: Qwen3 and Llama build with Bridge's local
(non-TE) layer spec as they are; a family whose table names a ``build`` module (DeepSeek-V3:
:mod:`conversion.testing.deepseek_v3_build`, Nemotron-H: :mod:`conversion.testing.nemotron_h_build`) gets its
``configure_provider`` and, if it has one, its ``build_context``.
"""

from __future__ import annotations

import contextlib
import importlib

import torch

from megatron_refit import families


def family(hf_config) -> str:
    """The family of ``hf_config``; ``ValueError`` naming the architecture if unsupported."""
    return families.of_config(hf_config).name


def _build_module(hf_config):
    module = families.of_config(hf_config).build
    return None if module is None else importlib.import_module(module)


def configure_provider(provider, hf_config, *, meta: bool = False) -> None:
    """Family-specific provider settings for a CPU (or meta-device) build (after the common ones)."""
    module = _build_module(hf_config)
    if module is not None:
        module.configure_provider(provider, meta=meta)


def build_context(hf_config, meta: bool):
    """The context the family's model is built in (around ``provide_distributed_model``)."""
    module = _build_module(hf_config)
    if module is not None and hasattr(module, "build_context"):
        return module.build_context(meta)
    return cpu_device_for_buffers(meta)


@contextlib.contextmanager
def cpu_device_for_buffers(meta: bool):
    """Megatron's MoE router creates ``expert_bias`` (DeepSeek's
    ``e_score_correction_bias``) on ``torch.cuda.current_device()``; on a CPU machine
    answer "cpu" (or "meta" for a meta-device build) while the model is built."""
    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: "meta" if meta else "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = saved
