"""Trainer-side FP8 refit end to end (gloo): what the gen side receives equals quantizing
Bridge's full export, bit for bit, at train TP1 / TP2 / TP2×EP2 into gen TP1×DP2 (HF
receiver, dequantized; logits against the Megatron forward with the same FP8 weights, and the
serving check on) and
gen TP2 (vLLM layout with fused FP8 weight and scale tiles). MoE experts into vLLM's fused
w13/w2 FP8 tiles: tests/engines/vllm/test_vllm_fp8.py (real vLLM)."""

from __future__ import annotations

import pytest

from megatron_refit.plan.gen_layout import GenLayout
from megatron_refit.local.evaluate import evaluate
from megatron_refit.local.harness import RunSpec, run
from megatron_refit.plan.layout import TrainLayout

pytestmark = pytest.mark.slow

ALIGNED = dict(hidden=256, heads=4, kv_heads=2, head_dim=128, ffn=256)
"""Every train and gen shard edge of the quantized weights on the 128 grid."""

CASES = [
    ("qwen3", TrainLayout(), GenLayout(tp=2)),
    ("qwen3", TrainLayout(tp=2), GenLayout(tp=1, dp=2)),
    ("qwen3-moe", TrainLayout(tp=2, ep=2), GenLayout(tp=1, dp=2)),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{m}-{t.describe()}-to-genTP{g.tp}xDP{g.dp}" for m, t, g in CASES])
def test_trainer_fp8_refit_bit_exact(case):
    model, train, gen = case
    spec = RunSpec(model=model, overrides=ALIGNED, train=train, gen=gen, refits=1, bucket_bytes=64 << 10,
                   fp8="trainer", verify_serving="on" if gen.tp == 1 else "off")
    result = evaluate(spec, run(spec))
    (refit,) = result["refits"]
    assert refit["bit_exact"] is True
    assert refit["bytes_sent"] == refit["bytes_minimal"] > 0
    if gen.tp == 1:
        assert result["max_logit_diff"] is not None and result["max_logit_diff"] <= 1e-5
        # the serving check's reference computes with the FP8 round trip: float32 noise only
        assert refit["serving"]["checked"] == gen.dp and refit["serving"]["max_dlogprob"] <= 1e-5
