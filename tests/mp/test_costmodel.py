"""The refit cost model on hand-computed cases, and its command line."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from megatron_refit.plan.cost import Cluster, placement, predict
from megatron_refit.tools.costmodel import route_bytes
from megatron_refit.plan.gen_layout import GenLayout, ModelShape, gen_target_specs
from megatron_refit.plan.refit_plan import RefitPlan
from megatron_refit.testing.reference_senders import SenderPlan, gen_classes
from megatron_refit.plan.spec import ShardSpec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTER = Cluster(gpus_per_node=8, nvlink_gbps=450.0, nic_gbps=50.0, copy_gbps=1500.0, efficiency=0.8,
                  latency_s=20e-6)


def test_one_pair_across_nodes():
    train_gpu, gen_gpu = placement(1, 1, "disaggregated", 8)
    assert (train_gpu, gen_gpu) == ([0], [8])  # gen ranks start on the next whole node
    got = predict({(0, 0): 40_000_000_000}, train_gpu, gen_gpu, CLUSTER, bucket_bytes=1_000_000_000)
    # 40 GB over 0.8 x 50 GB/s = 1 s, plus 40 messages of 20 us
    assert got.seconds == pytest.approx(1.0 + 40 * 20e-6)
    assert got.bottleneck.startswith("nic out of train rank 0 (GPU 0, node 0): 40.00 GB, 40 messages")
    assert got.per_gpu[8] == pytest.approx(got.seconds)


def test_links_in_parallel_and_device_copy():
    train_gpu, gen_gpu = placement(2, 2, "colocated", 8)
    pairs = {(0, 1): 36_000_000_000, (0, 0): 1_200_000_000, (1, 0): 3_600_000_000}
    got = predict(pairs, train_gpu, gen_gpu, CLUSTER, bucket_bytes=1 << 40)
    # GPU 0: NVLink out 36 GB / 360 GB/s = 0.1 s, in parallel with 3.6 GB in (0.01 s) and a
    # 1.2 GB device copy at 1200 GB/s (0.001 s); 3 messages (the device copy counts once).
    assert got.per_gpu[0] == pytest.approx(0.1 + 3 * 20e-6)
    assert got.per_gpu[1] == pytest.approx(0.1 + 2 * 20e-6)
    assert got.seconds == pytest.approx(0.1 + 3 * 20e-6)
    assert got.bottleneck.startswith("nvlink out of train rank 0 / gen rank 0 (GPU 0, node 0)")


def test_fan_in_makes_the_receiver_the_bottleneck():
    train_gpu, gen_gpu = placement(4, 1, "disaggregated", 2)
    assert gen_gpu == [4]
    pairs = {(src, 0): 10_000_000_000 for src in range(4)}  # 4 x 10 GB into one NIC
    got = predict(pairs, train_gpu, gen_gpu, dataclasses.replace(CLUSTER, gpus_per_node=2),
                  bucket_bytes=10_000_000_000)
    assert got.seconds == pytest.approx(40e9 / 40e9 + 4 * 20e-6)
    assert got.bottleneck.startswith("nic in of gen rank 0 (GPU 4, node 2)")


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="colocated placement needs as many gen ranks as train ranks, got 3 and 2"):
        placement(2, 3, "colocated", 8)
    with pytest.raises(ValueError, match="unknown placement mode 'shared'"):
        placement(2, 2, "shared", 8)
    with pytest.raises(ValueError, match="Cluster.nic_gbps must be positive, got 0"):
        Cluster(nic_gbps=0)
    with pytest.raises(ValueError, match="bucket_bytes must be positive"):
        predict({}, [0], [8], CLUSTER, bucket_bytes=0)


def test_pair_bytes_match_the_expanded_plan():
    train = {
        rank: [ShardSpec(name="l.self_attn.q_proj.weight", global_shape=(64, 32), dtype="bfloat16",
                         box=(((rank % 2) * 32, (rank % 2 + 1) * 32), (0, 32))),
               ShardSpec(name="l.input_layernorm.weight", global_shape=(32,), dtype="bfloat16", box=((0, 32),))]
        for rank in range(4)  # train TP2 x DP2
    }
    params = {s.name: (s.global_shape, s.dtype) for s in train[0]}
    gen = gen_target_specs(params, GenLayout(tp=2, dp=3), ModelShape(num_attention_heads=8, num_kv_heads=8,
                                                                      vocab_size=10))
    plan = RefitPlan.build(train, gen)
    expected: dict[tuple[int, int], int] = {}
    for bucket in plan.buckets:
        key = (bucket.src_rank, bucket.dst_rank)
        expected[key] = expected.get(key, 0) + bucket.payload_bytes
    assert route_bytes(SenderPlan.build(train, gen_classes(gen))) == expected
    assert sum(expected.values()) == plan.bytes_minimal


def test_command_line_on_a_shipped_config():
    out = subprocess.run([sys.executable, "-m", "megatron_refit.costmodel", "--config", "configs/qwen3-30b-a3b.yaml",
                          "--json"], capture_output=True, text=True, cwd=ROOT, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result) == {"ok", "model", "predicted_seconds", "bottleneck", "bytes_per_gen_rank_max", "swap",
                           "predicted_pause_seconds", "floor_seconds", "transport_seconds", "quantize_seconds",
                           "quantized_bytes_per_train_rank_max", "gen_tp", "gen_attention_dp", "gen_dp",
                           "gen_expert_parallel_size", "trainer_egress_bytes", "trainer_egress_minimal_bytes",
                           "trainer_egress_over_minimal"}
    # bf16 on the wire: nothing quantized; TP8xDP2 without expert parallelism: EP size 1
    assert result["quantize_seconds"] == 0 and result["transport_seconds"] == result["predicted_seconds"]
    assert (result["gen_tp"], result["gen_attention_dp"], result["gen_dp"], result["gen_expert_parallel_size"]) == (
        8, 1, 2, 1)
    assert result["floor_seconds"] == round(result["bytes_per_gen_rank_max"] / 40e9, 4)
    assert result["swap"] == "in_place" and result["predicted_pause_seconds"] == round(result["predicted_seconds"], 4)
    assert result["ok"] and result["model"] == "qwen3-30b-a3b"
    # EP8xPP2 -> TP8xDP2 on separate nodes: every gen rank takes 1/8 of a replica (7.68 GB)
    # through its 40 GB/s NIC; the senders are as loaded as the receivers.
    floor = result["bytes_per_gen_rank_max"] / 40e9
    assert floor <= result["predicted_seconds"] <= floor * 1.05
    assert "NeMo-RL reshard refit (H100)" in out.stdout and "0.74-1.00" in out.stdout


def test_delta_prediction_scales_the_bytes_by_the_encoding_and_adds_the_compare_pass():
    from megatron_refit.plan.cost import delta_fraction, delta_prediction

    assert delta_fraction(0.0) == 0.0 and delta_fraction(1.0) == 1.0
    assert delta_fraction(0.03) == pytest.approx(0.03 * 6 / 2)  # indices + values: 6 bytes per changed bf16
    assert delta_fraction(0.2) == pytest.approx((0.125 + 0.4) / 2)  # bitmask + values
    assert delta_fraction(0.95) == 1.0  # raw (a bitmask would add 1/8 byte per word)
    with pytest.raises(ValueError, match="delta density must be in"):
        delta_fraction(1.5)
    cluster = Cluster()
    pairs = {(0, 0): 8 * 10**9}  # one train GPU to one gen GPU on another node: 8 GB through the NIC
    train_gpu, gen_gpu = placement(1, 1, "disaggregated", cluster.gpus_per_node)
    full = predict(pairs, train_gpu, gen_gpu, cluster, bucket_bytes=1 << 29)
    delta = delta_prediction(pairs, train_gpu, gen_gpu, cluster, bucket_bytes=1 << 29, density=0.03)
    nic = 8e9 * 0.09 / 40e9
    compare = 2 * 8e9 / (1500e9 * 0.8)
    assert delta.seconds == pytest.approx(nic + compare + 20e-6, rel=1e-2)
    assert delta.seconds < full.seconds / 5


def test_command_line_predicts_a_delta_refit():
    out = subprocess.run([sys.executable, "-m", "megatron_refit.costmodel", "--config", "configs/qwen3-30b-a3b.yaml",
                          "--delta-density", "0.03", "--json"], capture_output=True, text=True, cwd=ROOT,
                         timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["delta_bytes_fraction"] == 0.09
    assert 0 < result["predicted_delta_seconds"] < 0.2 * result["predicted_seconds"]
    assert "delta at density 0.03" in out.stdout


def test_staged_swap_pause_is_a_device_copy_of_the_generation_rank_bytes():
    from megatron_refit.plan.cost import swap_pause

    cluster = Cluster()
    assert swap_pause(60 * 10**9, cluster) == pytest.approx(60e9 / (1500e9 * 0.8))  # vLLM: staging -> params
    assert swap_pause(60 * 10**9, cluster, copy=False) == 0.0  # a pointer swap
    # refit.swap_budget_mb: vLLM needs its staging buffers and the shadow (two copies), else it
    # loads under the pause (at least the copy); the HF engine pauses for the unshadowed share
    from megatron_refit.plan.cost import staged_pause

    copy = swap_pause(60 * 10**9, cluster)
    assert staged_pause(60 * 10**9, 2.0, cluster, engine="vllm", budget_bytes=None)[0] == copy
    assert staged_pause(60 * 10**9, 2.0, cluster, engine="vllm", budget_bytes=120 * 10**9)[0] == copy
    slow, how = staged_pause(60 * 10**9, 2.0, cluster, engine="vllm", budget_bytes=100 * 10**9)
    assert slow == copy and how.startswith("not prepared")
    assert staged_pause(60 * 10**9, 2.0, cluster, engine="hf", budget_bytes=15 * 10**9)[0] == pytest.approx(1.5)
    out = subprocess.run([sys.executable, "-m", "megatron_refit.costmodel", "--config", "configs/qwen3-30b-a3b.yaml",
                          "--swap", "staged", "--json"], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         check=False)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["swap"] == "staged"
    assert result["predicted_pause_seconds"] == round(swap_pause(result["bytes_per_gen_rank_max"], cluster), 4)
    assert result["predicted_pause_seconds"] < 0.05 * result["predicted_seconds"]


@pytest.mark.parametrize("mode", ["chain", "auto"])
def test_command_line_predicts_fanout_on_deepseek_v3(mode):
    """DeepSeek-V3 -> TP32xDP8 on the H100 defaults: a chain sends each byte from the train ranks
    once (direct: 8 times), yet gains little, since direct already runs near the floor every
    scheme shares: each gen rank's 43.9 GB through its own NIC (1.10 s at 40 GB/s). ``auto``
    (refit.fanout: auto) picks the chain there: a tree doubles each relay's egress."""
    out = subprocess.run([sys.executable, "-m", "megatron_refit.costmodel", "--config", "configs/deepseek-v3.yaml",
                          "--fanout", mode, "--json"], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         check=False)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    fanout = result["fanout"]
    assert fanout["mode"] == "chain" and fanout["depth"] == 7
    assert fanout["trainer_egress_over_minimal"] == 1.0 and fanout["direct_egress_over_minimal"] == 8.0
    assert fanout["bytes_relayed"] == 7 * fanout["bytes_from_trainers"]
    assert fanout["floor_seconds"] == round(result["bytes_per_gen_rank_max"] / 40e9, 4)
    assert fanout["floor_seconds"] < fanout["predicted_seconds"] < result["predicted_seconds"]
    assert "fan-out (chain): the train ranks send" in out.stdout and "floor of any scheme" in out.stdout
