"""What an engine serves, read from its Hugging Face config (generation side; no Megatron).

:func:`model_shape` gives the sizes the engine sharding rules need; :func:`hf_param_table`
the checkpoint's parameter names, global shapes and dtypes. Together with a
:class:`~megatron_refit.plan.gen_layout.GenLayout` they say which pieces an engine rank holds
(:func:`~megatron_refit.plan.gen_layout.gen_target_specs`), with no checkpoint file read.
"""

from __future__ import annotations

import torch

from megatron_refit.plan.gen_layout import ModelShape


def num_routed_experts(hf_config) -> int:
    """Routed experts per MoE layer (``num_experts`` or ``n_routed_experts``); 0 if dense."""
    return getattr(hf_config, "num_experts", None) or getattr(hf_config, "n_routed_experts", None) or 0


def model_shape(hf_config) -> ModelShape:
    """Heads, KV heads, vocabulary and routed experts of a transformers config."""
    return ModelShape(
        num_attention_heads=hf_config.num_attention_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
        vocab_size=hf_config.vocab_size,
        num_experts=num_routed_experts(hf_config),
    )


def hf_param_table(hf_config, dtype: torch.dtype | str, *,
                   draft: bool = False) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{checkpoint name: (global shape, dtype)}`` of the model ``hf_config`` describes, with
    every weight in ``dtype`` (a refit copies bytes, it never casts: the trainer sends this
    dtype). Built on the meta device (no memory, no download); names as in a checkpoint,
    routed experts per expert, a tied ``lm_head`` left out, persistent buffers that
    checkpoints carry (DeepSeek's ``e_score_correction_bias``) included; ``draft``: the MTP
    layers an engine's speculative draft holds too (``model.layers.<N + i>.*``:
    :class:`~megatron_refit.engines.hf.draft.MTPDraft`)."""
    from transformers import AutoModelForCausalLM

    from megatron_refit.engines.hf.storage import HFStorage

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
        mtp = None
        if draft:
            from megatron_refit.engines.hf.draft import MTPDraft

            mtp = MTPDraft(model, hf_config).to(dtype=dtype)
    return {s.name: (s.global_shape, s.dtype) for s in HFStorage(model, draft=mtp).target_specs()}
