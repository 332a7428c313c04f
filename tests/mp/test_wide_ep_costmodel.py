"""The cost model on the shipped wide expert-parallel configs (#64 item 6): its JSON names the
deployment, the per-gen-rank floor, trainer egress against the minimal and the trainer's FP8
quantization, consistently; Kimi-K2 at the record's setup meets the issue's targets."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest

from megatron_refit.tools.dryrun import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@functools.cache
def _costmodel(config: str) -> tuple[dict, str]:
    out = subprocess.run([sys.executable, "-m", "megatron_refit.costmodel", "--config", config, "--json"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stdout


@pytest.mark.parametrize("name", ["kimi-k2-fp8-256to128", "deepseek-v3-wide-ep"])
def test_wide_ep_config_cost_model_fields_are_consistent(name):
    config = os.path.join(ROOT, "configs", f"{name}.yaml")
    refit, _, _ = load_config(config)
    result, text = _costmodel(config)
    assert result["ok"]
    assert (result["gen_tp"], result["gen_attention_dp"], result["gen_dp"]) == (
        refit.gen_tp, refit.gen_attention_dp, refit.gen_dp)
    assert refit.gen_attention_dp > 1 and refit.gen_expert_parallel
    assert result["gen_expert_parallel_size"] == refit.gen_attention_dp * refit.gen_tp
    # the floor: the busiest gen rank's bytes through its own NIC at 0.8 x 50 GB/s; nothing beats it
    assert result["floor_seconds"] == round(result["bytes_per_gen_rank_max"] / 40e9, 4)
    assert result["floor_seconds"] <= result["transport_seconds"] <= result["predicted_seconds"]
    # FP8 quantized on the train GPUs at the stated rate, counted on them: at most the serial bound
    assert result["quantized_bytes_per_train_rank_max"] > 0
    assert result["quantize_seconds"] == round(result["quantized_bytes_per_train_rank_max"] / 128e9, 4)
    assert result["predicted_seconds"] <= result["transport_seconds"] + result["quantize_seconds"] + 0.01
    # each of a deployment's D data-parallel ranks gets its attention from the train ranks: more than the
    # minimal (each byte once per deployment), at most D times it
    egress, minimal = result["trainer_egress_bytes"], result["trainer_egress_minimal_bytes"]
    assert minimal < egress <= refit.gen_attention_dp * minimal
    assert result["trainer_egress_over_minimal"] == round(egress / minimal, 4)
    assert f"deployment vllm D{refit.gen_attention_dp}xT{refit.gen_tp}, EP{result['gen_expert_parallel_size']}" in text
    assert "per-gen-rank floor" in text and "trainer egress" in text and "trainer-side FP8" in text
    # forwarding a deployment's dense weights inside it, weighed against sending them direct: from DP
    # rank 0 in a chain or tree the trainers send them once per deployment, but DP rank 0 still takes
    # them through its NIC and the relays add hops, so it is slower; split over the DP ranks sharing a
    # node (node) each NIC takes a share: faster where DP ranks share nodes (D32 x T1), the same at
    # D16 x T8 (one DP rank a node); the refit sends direct, and the tool says so where it picks another
    forwarding = result["deployment_forwarding"]
    configured = forwarding["configured"]
    assert configured == ("node" if refit.gen_dense_forward == "node" else "direct")
    assert forwarding[f"{configured}_seconds"] == result["transport_seconds"]
    assert forwarding[f"{configured}_trainer_egress_bytes"] == egress
    direct = forwarding["direct_trainer_egress_bytes"]
    for mode in ("chain", "tree"):
        saved = (refit.gen_attention_dp - 1) * refit.gen_dp * forwarding["dense_bytes_per_dp_rank"]
        assert forwarding[f"{mode}_trainer_egress_bytes"] == direct - saved
        assert forwarding[f"{mode}_seconds"] > forwarding["direct_seconds"]
    shared = refit.gen_tp < 8  # 8 GPUs a node: DP ranks share one
    assert (forwarding["node_seconds"] < forwarding["direct_seconds"]) == shared
    assert (forwarding["node_trainer_egress_bytes"] < direct) == shared
    assert forwarding["picked"] == ("node" if shared else "direct") == configured  # the shipped configs follow it
    assert f"picked: {forwarding['picked']}" in text and f"this config runs {configured}" in text


def test_kimi_k2_at_the_record_setup_meets_the_targets():
    """256 BF16 training GPUs -> 128 FP8 inference GPUs (Perplexity's 1.3 s): <= 0.65 s and <= 1.3x the floor."""
    result, text = _costmodel(os.path.join(ROOT, "configs", "kimi-k2-fp8-256to128.yaml"))
    assert result["predicted_seconds"] <= 0.65
    assert result["predicted_seconds"] <= 1.3 * result["floor_seconds"]
    assert "Perplexity (record, in-house engine)" in text


def test_deepseek_v3_wide_ep_is_printed_beside_the_published_times():
    result, text = _costmodel(os.path.join(ROOT, "configs", "deepseek-v3-wide-ep.yaml"))
    assert "2.39-2.83" in text and "7.65-9.94" in text
    assert "D32xT1 EP32 R32 x8" in text and "32 redundant experts" in text
