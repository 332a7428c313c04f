"""SGLang 0.5.23's block-FP8 models on CPU (``.venv-sglang``), next to :mod:`.sglang_cpu`.

An FP8 checkpoint's model directory is its ``config.json`` with a ``quantization_config``
(``quant_method: fp8``, dynamic activations, 128×128 weight blocks): SGLang's ``Fp8Config``
gives every ``LinearBase`` ``Fp8LinearMethod`` and every ``FusedMoE`` ``Fp8MoEMethod``, whose
``create_weights`` register ``weight`` / ``w13_weight`` / ``w2_weight`` in float8_e4m3fn in
the checkpoint's ``[out, in]`` layout and float32 ``weight_scale_inv`` /
``w13_weight_scale_inv`` / ``w2_weight_scale_inv`` tiles of ``ceil(out/128) × ceil(in/128)``
(``sglang/srt/layers/quantization/fp8.py``: ``create_fp8_weight_`` lines 613-714, the scale
tiles 668-689; ``create_fp8_moe_weight_`` lines 1545-1824, the scale tiles 1720-1746). Those
are the names and layout of vLLM's block-FP8 parameters: the family tables need no SGLang
alias. Paths below are relative to ``site-packages/sglang/srt``.

:func:`build_fp8_model` builds through SGLang's ``ModelConfig`` and dummy loader, post-load
included (``model_loader/loader.py`` 1493-1532, the post-load loop 1521-1530), as
:func:`.sglang_cpu.build_model` does, in bfloat16. That post-load repacks nothing here:
these processes have the platform flags of a host without SGLang's CPU engine
(``is_cpu()`` is True only with ``SGLANG_USE_CPU_ENGINE=1``, ``utils/common.py`` 221-224,
read once at ``layers/quantization/fp8.py:132``; with it set, SGLang does not import
without an ``sgl_kernel`` built from source), so ``process_weights_after_loading`` takes the
generic branch (``fp8.py`` 835-943 linear, 2189-2289 MoE), whose steps are all off for
128×128 float32 scales on a host without CUDA (DeepGEMM UE8M0 requant,
``layers/quantization/fp8_utils.py`` 2166-2177; the Hopper BF16 cache, MXFP8, aiter, XPU):
parameters keep their storage, shape, dtype and bytes. SGLang's CPU-engine branch could not
run here and would not keep the checkpoint layout: ``fp8.py`` 826-834 (linear) and
2184-2188 (MoE) ``assert _is_cpu_amx_available`` (AMX tiles and ``sgl_kernel``'s
``convert_weight_packed``, ``utils/common.py`` 354-372; these AMD CPUs have neither), then
``_amx_process_weight_after_loading`` replaces the weight by a new, AMX-packed Parameter
(``layers/amx_utils.py`` 127-170). Nothing here runs a matmul.
"""

from __future__ import annotations

import json
import os

import torch


MLA_DOWN = ("q_a_proj", "kv_a_proj_with_mqa")
"""MLA's low-rank down projections, which trainer-side FP8 keeps in bf16 (SGLang fuses them into
``fused_qkv_a_proj_with_mqa``)."""


def fp8_quant_config(hf_config, *, nextn_names: bool = True) -> dict:
    """``quantization_config`` of a 128×128 block-FP8 checkpoint (DeepSeek-V3's format) of what
    trainer-side FP8 sends: the MoE routers listed as not converted (SGLang's Qwen3-MoE builds its
    router unquantized anyway), and in an MLA model its down projections (:data:`MLA_DOWN`), of
    every layer and of the NextN draft's.

    SGLang's ``Fp8Config`` matches a module's prefix against these names on dotted boundaries
    (``layers/quantization/utils.py`` ``is_layer_skipped`` / ``_module_path_match``), unfusing
    ``fused_qkv_a_proj_with_mqa`` into its two shards through the DeepSeek model's
    ``packed_modules_mapping``. The NextN draft's modules are ``model.decoder.*``, and SGLang maps
    a checkpoint name onto them only for DeepSeek-V3's own MTP index (``DeepseekV3ForCausalLMNextN
    .hf_to_sglang_mapper``: ``model.layers.61`` -> ``model.decoder``, applied to ``ignored_layers``
    by ``Fp8Config.apply_weight_name_mapper``): with any other ``num_hidden_layers`` the checkpoint
    name ``model.layers.<N>.self_attn.q_a_proj`` leaves the draft's FP8, so the draft's are listed
    under SGLang's spelling too (``nextn_names``; False: the checkpoint's names only, as vLLM takes them)."""
    experts = (getattr(hf_config, "num_experts", 0) or getattr(hf_config, "num_local_experts", 0)
               or getattr(hf_config, "n_routed_experts", 0))
    skipped = [f"model.layers.{i}.mlp.gate" for i in range(hf_config.num_hidden_layers)] if experts else []
    if getattr(hf_config, "q_lora_rank", None) is not None:
        mtp = getattr(hf_config, "num_nextn_predict_layers", 0) or 0
        skipped += [f"model.layers.{i}.self_attn.{m}" for i in range(hf_config.num_hidden_layers + mtp)
                    for m in MLA_DOWN]
        skipped += [f"model.decoder.self_attn.{m}" for m in MLA_DOWN] if mtp and nextn_names else []
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
            "modules_to_not_convert": skipped}


def write_fp8_model_dir(hf_config, model_dir: str) -> str:
    """A model directory of a block-FP8 checkpoint as SGLang's ``ModelConfig`` reads it:
    ``config.json`` only, with :func:`fp8_quant_config`."""
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(dict(hf_config.to_dict(), quantization_config=fp8_quant_config(hf_config)), f)
    return model_dir


def build_fp8_model(model_dir: str) -> torch.nn.Module:
    """SGLang's block-FP8 model for ``model_dir`` on this TP rank (bfloat16 outside the
    quantized layers), built by SGLang's dummy loader with its post-load steps."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import get_model_loader

    model_config = ModelConfig(model_dir, dtype="bfloat16")
    if model_config.quantization != "fp8":
        raise ValueError(f"{model_dir}: SGLang reads quantization {model_config.quantization!r}, not fp8")
    loader = get_model_loader(LoadConfig(load_format="dummy"), model_config)
    model = loader.load_model(model_config=model_config, device_config=DeviceConfig("cpu"))
    quant = {type(getattr(m, "quant_method", None)).__name__ for m in model.modules()}
    if "Fp8LinearMethod" not in quant:
        raise ValueError(f"SGLang built no block-FP8 layers from {model_dir} (quant methods {sorted(quant)})")
    return model


def build_fp8_draft(model_dir: str, target: torch.nn.Module) -> torch.nn.Module:
    """SGLang's speculative draft of the block-FP8 ``model_dir`` beside ``target``
    (:func:`.sglang_cpu.build_draft` in bfloat16: a DeepSeek-V3's ``DeepseekV3ForCausalLMNextN``,
    FP8 where its ``Fp8Config`` says)."""
    from .sglang_cpu import build_draft

    return build_draft(model_dir, target, dtype="bfloat16")
