"""LoRA refit end to end: refit 1 moves base + adapters, later refits only the adapters; the
generation model (base + merged adapters) equals Bridge's merged export bit for bit."""

from __future__ import annotations

import pytest
import torch

from megatron_refit.plan.gen_layout import GenLayout
from megatron_refit.local.evaluate import evaluate
from megatron_refit.local.harness import RunSpec, run
from megatron_refit.plan.layout import TrainLayout

RANK = 4


@pytest.mark.slow
def test_lora_refit_sends_adapters_only_after_the_first():
    from conversion.presets import hf_config

    spec = RunSpec(model="qwen3", train=TrainLayout(tp=2), gen=GenLayout(tp=1, dp=2), refits=3, lora_rank=RANK,
                   bucket_bytes=64 << 10, verify_serving="on")
    result = evaluate(spec, run(spec))
    assert result["bit_exact"] is True and all(r["bit_exact"] for r in result["refits"])
    assert result["max_logit_diff"] <= 1e-5
    # the engines merge the adapters, the trainer's forward adds their product: the same model
    assert all(r["serving"]["checked"] == 2 and r["serving"]["max_dlogprob"] <= 1e-5 for r in result["refits"])
    cfg = hf_config("qwen3")
    h, q, kv, ffn = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, \
        cfg.intermediate_size
    # A [rank, in] + B [out, rank] of q, k, v, o, gate, up, down, per layer, fp32, to 2 engine replicas
    per_layer = RANK * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + ffn) + (ffn + h))
    adapter_bytes = per_layer * cfg.num_hidden_layers * 4 * spec.gen.dp
    first, *later = result["refits"]
    assert first["bytes_sent"] > 10 * adapter_bytes
    assert all(r["bytes_sent"] == r["bytes_minimal"] == adapter_bytes for r in later)
    assert result["refits"][1]["loss"] != result["refits"][2]["loss"]  # the adapters trained


def test_lora_receiver_refuses_adapters_without_base():
    from transformers import Qwen3Config

    from megatron_refit.engines.hf.storage import HFStorage
    from megatron_refit.endpoint.lora import LoraStorage

    cfg = Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    lora = LoraStorage(HFStorage.from_config(cfg), rank=2, alpha=4)
    names = {s.name for s in lora.adapters().target_specs()}
    assert "model.layers.0.self_attn.q_proj.lora_A.weight" in names and len(names) == 14
    assert not any("mlp.gate.weight" in n or "embed" in n or "norm" in n for n in names)
    with pytest.raises(RuntimeError, match="holds no base weights"):
        lora.adapters().finalize()
    for spec in lora.full().target_specs():
        lora.buffer(spec.name).copy_(torch.randn(spec.global_shape))
    lora.full().finalize()
    a, b = lora.a["model.layers.0.mlp.down_proj.lora_A.weight"], lora.b["model.layers.0.mlp.down_proj.lora_B.weight"]
    want = lora.base["model.layers.0.mlp.down_proj.weight"] + 2.0 * (b @ a)
    assert torch.equal(lora.hf.buffer("model.layers.0.mlp.down_proj.weight"), want)
    lora.drop_base()
    with pytest.raises(RuntimeError, match="full refit"):
        lora.adapters().finalize()
    with pytest.raises(ValueError, match="rank must be a positive int"):
        LoraStorage(lora.hf, rank=0, alpha=1)
