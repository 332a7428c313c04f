"""The private Megatron-Bridge / Megatron-Core names ``conversion/`` relies on, in one place.

Enumerating local shards without collectives, splitting Bridge's mappings locally and the
TE FP8 pass-through need a few names that Bridge and Megatron-Core do not export: they are
why ``requirements/megatron.txt`` pins both packages exactly. Every use goes through a
function here; :data:`PRIVATE_NAMES` lists them and :func:`missing_private_names` checks
them against the installed packages (``tests/unit/test_bridge_api.py`` runs it, and fails if a
module of ``conversion/`` other than this one touches a private name). Moving a pin means
reading this file's list, not the whole package.
"""

from __future__ import annotations

import importlib
import inspect

from conversion.te_shim import import_bridge

import_bridge()
from megatron.bridge.models.conversion import model_bridge as _model_bridge_module  # noqa: E402

PRIVATE_NAMES = (
    # (module, object path, kind): "function" / "class" / "method" resolve by getattr along the
    # path; "instance" is an attribute the class's own code sets on self (checked in its source)
    ("megatron.bridge.models.conversion.model_bridge", "_megatron_local_name_to_global", "function"),
    ("megatron.bridge.models.conversion.model_bridge", "_HFNameSuffixMapping", "class"),
    ("megatron.bridge.models.conversion.model_bridge", "_HFNameSuffixMapping._suffix", "instance"),
    ("megatron.bridge.models.conversion.model_bridge", "_HFNameSuffixMapping._base_mapping", "instance"),
    ("megatron.bridge.models.conversion.auto_bridge", "AutoBridge._model_bridge", "method"),  # a property
    ("megatron.bridge.models.conversion.model_bridge", "MegatronModelBridge._unwrap_name", "method"),
    ("megatron.bridge.models.conversion.model_bridge", "MegatronModelBridge._is_adapter_param_name", "method"),
    ("megatron.bridge.models.conversion.model_bridge", "MegatronModelBridge._cached_param_names", "instance"),
    ("megatron.bridge.models.conversion.param_mapping", "AutoMapping._detect_parallelism_type", "method"),
    ("megatron.bridge.models.conversion.param_mapping", "MegatronParamMapping._get_config", "method"),
    ("megatron.bridge.models.conversion.param_mapping", "QKVMapping._tp_mapping", "instance"),
    ("megatron.core.transformer.moe.router", "TopKRouter._maintain_float32_expert_bias", "method"),
    ("megatron.core.post_training.modelopt.hybrid.model_specs", "_get_hybrid_stack_local_spec", "function"),
)


def missing_private_names() -> list[str]:
    """The entries of :data:`PRIVATE_NAMES` the installed packages lack (empty at the pins)."""
    missing = []
    for module_name, path, kind in PRIVATE_NAMES:
        try:
            obj = importlib.import_module(module_name)
            *owners, attr = path.split(".")
            for part in owners:
                obj = getattr(obj, part)
            if kind == "instance":
                found = any(f"self.{attr} =" in inspect.getsource(cls) or f"self.{attr}:" in inspect.getsource(cls)
                            for cls in inspect.getmro(obj) if cls.__module__.startswith("megatron"))
            else:
                found = hasattr(obj, attr)
        except (ImportError, AttributeError, OSError, TypeError):
            found = False
        if not found:
            missing.append(f"{module_name}.{path} ({kind})")
    return missing


SuffixMapping = _model_bridge_module._HFNameSuffixMapping
"""Bridge's wrapper that exports a mapping's tensors under names with a suffix (FP8
``*_scale_inv`` siblings of a weight)."""


def model_bridge_of(bridge):
    """The ``MegatronModelBridge`` behind an ``AutoBridge``."""
    return bridge._model_bridge


def unwrap_name(model_bridge, local_name: str) -> str:
    """A parameter's name without DDP / Float16Module wrapper prefixes."""
    return model_bridge._unwrap_name(local_name)


def local_name_to_global(model: list, config, local_name: str, vp_stage: int) -> str:
    """Bridge's renaming of a rank-local parameter name (PP layer offset, EP expert offset)."""
    return _model_bridge_module._megatron_local_name_to_global(model, config, local_name, vp_stage)


def is_adapter_param_name(model_bridge, name: str) -> bool:
    return model_bridge._is_adapter_param_name(name)


def prime_param_names(model_bridge, names: list[str]) -> None:
    """Set the parameter names ``build_conversion_tasks`` would otherwise all-gather over PP."""
    model_bridge._cached_param_names = names


def suffix_parts(mapping) -> tuple[str, object] | None:
    """``(suffix, base mapping)`` of a :data:`SuffixMapping`, else None."""
    if isinstance(mapping, SuffixMapping):
        return mapping._suffix, mapping._base_mapping
    return None


def parallelism_of(mapping, module) -> str:
    """``"column"`` / ``"row"`` / ``"replicated"``, as Bridge detects it for an AutoMapping."""
    return mapping._detect_parallelism_type(module)


def qkv_parallelism_of(mapping, module) -> str:
    """The same for the tensor-parallel mapping inside a QKVMapping."""
    return mapping._tp_mapping._detect_parallelism_type(module)


def config_of(mapping, module):
    """The TransformerConfig a mapping reads head counts from."""
    return mapping._get_config(module)


def keep_expert_bias_fp32(router) -> None:
    """Megatron's router keeps its expert bias in float32 whatever the model dtype."""
    router._maintain_float32_expert_bias()


def hybrid_stack_local_spec(norm):
    """Megatron's local (non-TE) hybrid (Mamba) stack spec with local core attention, built
    with ``norm`` in place of ``modelopt.layers.Norm`` (a TE wrapper)."""
    from megatron.core.post_training.modelopt.hybrid import model_specs

    saved = model_specs.Norm
    model_specs.Norm = norm
    try:
        return model_specs._get_hybrid_stack_local_spec(local_core_attention=True)
    finally:
        model_specs.Norm = saved
