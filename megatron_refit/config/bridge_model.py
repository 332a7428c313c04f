"""The trainer layout from a training YAML's Bridge sections, as Megatron-Bridge's recipes write
them (``cfg.model.<key> = …``): every key that decides which weights a rank holds is honoured;
any other parallel key is known to decide none of it, or is refused by name. None is ignored.
"""

from __future__ import annotations

import difflib
import math
import re
from typing import Any

from megatron_refit.config.section import RefitConfig
from megatron_refit.plan.layout import TrainLayout

HONOURED = {
    "tensor_model_parallel_size": "tp",
    "pipeline_model_parallel_size": "pp",
    "virtual_pipeline_model_parallel_size": "vpp",
    "context_parallel_size": "cp",
    "expert_model_parallel_size": "ep",
    "expert_tensor_parallel_size": "etp",
    "num_layers_in_first_pipeline_stage": "first_stage_layers",
    "num_layers_in_last_pipeline_stage": "last_stage_layers",
    "account_for_embedding_in_pipeline_split": "account_for_embedding",
    "account_for_loss_in_pipeline_split": "account_for_loss",
    "pipeline_model_parallel_layout": "layout",
    "mtp_num_layers": "mtp_layers",
    "sequence_parallel": "sequence_parallel",
}
"""Bridge ``model:`` (GPTModelProvider) field -> :class:`TrainLayout` field."""

INERT = frozenset({
    # how ranks communicate, overlap or schedule; never which weights they hold
    "pipeline_dtype", "pipeline_model_parallel_comm_backend", "microbatch_group_size_per_vp_stage",
    "deallocate_pipeline_outputs", "overlap_p2p_comm", "batch_p2p_comm", "overlap_p2p_comm_warmup_flush",
    "variable_seq_lengths", "cp_comm_type", "max_seqlen_per_dp_cp_rank", "hybrid_context_parallel",
    "overlap_moe_expert_parallel_comm", "ep_overlap_early_attn_memory_release", "tp_only_amax_red",
    "inference_fuse_tp_communication", "delta_offload_bytes_across_pp_ranks", "parallel_output",
    "scatter_embedding_sequence_parallel", "tp_comm_overlap_cfg", "tp_comm_bootstrap_backend",
    "defer_embedding_wgrad_compute",
    # the MTP loss and its schedule (mtp_standalone is derived from the layout)
    "mtp_loss_scaling_factor", "mtp_detach_heads", "mtp_enabled", "mtp_standalone", "mtp_grad_scale_func",
})
"""Parallel keys that decide nothing about which weights a rank holds (accepted as they are)."""

DEFAULT_ONLY = {
    "gtp_weight_remat_size": 1,
    "expert_gtp_weight_remat_size": 1,
    "mtp_use_repeated_layer": False,
    "mtp_hybrid_override_pattern": None,
}
"""Keys that change which weights a rank holds (or their names) and are not supported: accepted
only at their default."""

_CONSISTENT = ("hierarchical_context_parallel_sizes", "tensor_parallel_num_weight_shards",
               "expert_tensor_parallel_num_weight_shards")
"""Keys accepted where they agree with the honoured sizes (checked by :func:`_check_consistent`)."""

_PARALLEL = re.compile(r"parallel|pipeline|(^|_)(pp|vp|cp|tp|ep)(_|$)|^mtp_|num_layers_in_|account_for_|"
                       r"weight_shards|remat")
"""What makes a ``model:`` key a parallel key (one that must be known)."""

FSDP = (("dist", "use_megatron_fsdp"), ("ddp", "use_megatron_fsdp"), ("dist", "use_torch_fsdp2"))


def train_layout(bridge_config: dict[str, Any], refit: RefitConfig, *, num_experts: int | None = None,
                 mtp_layers: int | None = None) -> TrainLayout:
    """The trainer layout from Bridge's ``model:`` section and ``refit.train_dp``; ``ValueError``
    naming a key that cannot be honoured, before anything starts. What the model is, when known,
    gives Bridge's defaults of the keys the section leaves out: ``num_experts`` (its routed
    experts) the expert tensor parallelism (1 under expert parallelism, else Megatron's: the
    tensor-parallel size), ``mtp_layers`` (the HF config's ``num_nextn_predict_layers``) the
    MTP layers."""
    model = bridge_config.get("model") or {}
    if not isinstance(model, dict):
        raise ValueError(f"model: expected a mapping, got {type(model).__name__}")
    _refuse_unknown(model)
    _refuse_fsdp(bridge_config)
    fields: dict[str, Any] = {}
    for key, field in HONOURED.items():
        value = model.get(key)
        if value is None:
            continue
        if field in ("account_for_embedding", "account_for_loss", "sequence_parallel"):
            if not isinstance(value, bool):
                raise ValueError(f"model.{key}: expected true or false, got {value!r}")
        elif field == "layout":
            if not isinstance(value, (str, list)):
                raise ValueError(f"model.{key}: expected a string or a list of lists of layer types, got {value!r}")
        elif not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"model.{key}: expected int, got {value!r}")
        fields[field] = value
    if "mtp_layers" not in fields and mtp_layers:
        fields["mtp_layers"] = mtp_layers
    if "etp" not in fields and num_experts:
        fields["etp"] = 1 if fields.get("ep", 1) > 1 else fields.get("tp", 1)
    dp = refit.train_dp
    if dp is None:  # the fewest data-parallel ranks that hold every expert
        experts = fields.get("ep", 1) * fields.get("etp", 1)
        dp = experts // math.gcd(fields.get("tp", 1) * fields.get("cp", 1), experts)
    layout = TrainLayout(dp=dp, **fields)
    _check_consistent(model, layout)
    return layout


def _check_consistent(model: dict, layout: TrainLayout) -> None:
    sizes = model.get("hierarchical_context_parallel_sizes")
    if sizes is not None and (not isinstance(sizes, list) or math.prod(sizes) != layout.cp):
        raise ValueError(f"model.hierarchical_context_parallel_sizes={sizes!r}: their product must be "
                         f"context_parallel_size={layout.cp}")
    for key, size, axis in (("tensor_parallel_num_weight_shards", layout.tp, "tensor_model_parallel_size"),
                            ("expert_tensor_parallel_num_weight_shards", layout.etp, "expert_tensor_parallel_size")):
        shards = model.get(key)
        if shards is not None and shards != size:
            raise ValueError(f"model.{key}={shards!r}: weight shards beyond {axis}={size} are not supported by "
                             "the refit (it changes which weights a rank holds)")


def _refuse_unknown(model: dict) -> None:
    known = set(HONOURED) | INERT | set(DEFAULT_ONLY) | set(_CONSISTENT)
    for key in model:
        if not isinstance(key, str) or key in known:
            continue
        near = difflib.get_close_matches(key, list(HONOURED), n=1, cutoff=0.85)
        if near:
            raise ValueError(f"model.{key}: unknown key; did you mean {near[0]!r}? (as written, it would be ignored)")
        if _PARALLEL.search(key):
            raise ValueError(f"model.{key}: a parallel setting the refit does not know, so it cannot plan which "
                             f"weights each rank holds; known: {sorted(HONOURED)} (and the settings that move no "
                             "weight: docs/configuration.md)")
    for key, default in DEFAULT_ONLY.items():
        if key in model and model[key] != default and model[key] is not None:
            raise ValueError(f"model.{key}={model[key]!r}: not supported by the refit (it changes which weights a "
                             f"rank holds); use {default!r}")


def _refuse_fsdp(bridge_config: dict) -> None:
    for section, key in FSDP:
        value = (bridge_config.get(section) or {}).get(key) if isinstance(bridge_config.get(section), dict) else None
        if value:
            raise ValueError(f"{section}.{key}: true shards each parameter over the data-parallel ranks; the refit "
                             "reads every rank's whole local tensors (DDP or the distributed optimizer)")
