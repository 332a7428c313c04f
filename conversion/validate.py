"""Check a trainer layout against a model config before anything is built or started."""

from __future__ import annotations

from megatron_refit.families import of_config
from megatron_refit.plan.layout import TrainLayout

from conversion.presets import num_routed_experts


def check_train_layout(hf_config, layout: TrainLayout) -> None:
    """``ValueError`` naming the first size that the layout does not divide."""
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    checks = [
        ("num_attention_heads", heads, "tp", layout.tp),
        ("num_key_value_heads", kv, "tp", layout.tp),
        ("intermediate_size", hf_config.intermediate_size, "tp", layout.tp),
        ("hidden_size", hf_config.hidden_size, "tp", layout.tp),
    ]
    layout.chunk_layers(hf_config.num_hidden_layers)  # ValueError naming the keys if the layers do not split
    mtp = getattr(hf_config, "num_nextn_predict_layers", None) or 0
    if layout.mtp_layers > mtp:  # fewer (0: MTP off, as a recipe may set) build what Bridge maps
        raise ValueError(f"mtp_num_layers={layout.mtp_layers} but the model has only {mtp} MTP layers "
                         f"(num_nextn_predict_layers={mtp}): Bridge maps the HF config's MTP layers")
    family_checks = of_config(hf_config).layout_checks(hf_config)  # e.g. MLA ranks, Mamba heads and groups
    checks += [(field, size, axis, getattr(layout, axis)) for field, size, axis in family_checks]
    experts = num_routed_experts(hf_config)
    if experts:
        checks += [
            ("num_experts", experts, "ep", layout.ep),
            ("moe_intermediate_size", hf_config.moe_intermediate_size, "etp", layout.etp),
        ]
    elif layout.ep > 1 or layout.etp > 1:
        raise ValueError(f"layout {layout.describe()} has expert parallelism but the model has no experts")
    for field, size, axis, parallel in checks:
        if size % parallel:
            raise ValueError(
                f"model {field}={size} is not divisible by train {axis}={parallel} (layout {layout.describe()})"
            )
