"""The cost model's pieces for a wide expert-parallel deployment with trainer-side FP8 (#64 item 6): the
per-gen-rank floor, the bf16 bytes each train rank quantizes (each piece it sends from, once; checked
against the plan's transfers expanded), and those seconds counted on the quantizing GPU."""

from __future__ import annotations

import math

import pytest

from megatron_refit.plan.assignment import Assignment
from megatron_refit.plan.cost import Cluster, nic_floor, placement, predict, quantize_busy, quantized_bytes
from megatron_refit.plan.expert_placement import vllm_placement
from megatron_refit.plan.fp8_layout import fp8_param_table, fp8_specs, is_quantized
from megatron_refit.plan.gen_layout import GenLayout, ModelShape, gen_targets
from megatron_refit.plan.spec import ShardSpec, box_along, full_box

H, E = 256, 4
ATTN = "model.layers.0.self_attn.o_proj.weight"
NORM = "model.layers.0.input_layernorm.weight"


def _expert(e: int) -> str:
    return f"model.layers.0.mlp.experts.{e}.down_proj.weight"


def _train() -> dict[int, list[ShardSpec]]:
    """Train TP2 x EP2 x DP2 in bf16: o_proj split by columns over TP and replicated over DP (rank =
    dp * 2 + tp), expert e whole on the rank e % 4, the norm on every rank; as trainer-side FP8 sends it."""
    out = {}
    for rank in range(4):
        tp = rank % 2
        specs = [ShardSpec(name=ATTN, global_shape=(H, H), dtype="bfloat16", box=box_along((H, H), 1, tp * 128,
                                                                                             (tp + 1) * 128)),
                 ShardSpec(name=NORM, global_shape=(H,), dtype="bfloat16", box=((0, H),)),
                 ShardSpec(name=_expert(rank), global_shape=(H, 128), dtype="bfloat16", box=full_box((H, 128)),
                           is_expert=True)]
        out[rank] = [q for s in specs for q in (fp8_specs(s) if is_quantized(s.name, s.global_shape) else (s,))]
    return out


def _plan(attention_dp: int, tp: int) -> Assignment:
    params = fp8_param_table({ATTN: ((H, H), "bfloat16"), NORM: ((H,), "bfloat16"),
                              **{_expert(e): ((H, 128), "bfloat16") for e in range(E)}})
    model = ModelShape(num_attention_heads=4, num_kv_heads=4, vocab_size=64, num_experts=E)
    ep = tp * attention_dp
    layout = GenLayout(tp=tp, attention_dp=attention_dp, expert_parallel=True,
                       placement=vllm_placement(num_logical_experts=E, ep_size=ep, num_redundant=ep, eplb=True))
    return Assignment.build(_train(), gen_targets(params, layout, model))


@pytest.mark.parametrize("attention_dp, tp", [(2, 1), (2, 2), (4, 1)])
def test_each_train_rank_quantizes_each_piece_it_sends_once(attention_dp, tp):
    senders = _plan(attention_dp, tp)
    expected = [0, 0, 0, 0]
    seen = set()
    for t in senders.transfers():  # the plan expanded: every FP8 weight a rank sends from, once
        if t.dtype == "float8_e4m3fn" and (t.src_rank, t.name) not in seen:
            seen.add((t.src_rank, t.name))
            expected[t.src_rank] += H * 128 * 2  # an o_proj half and an expert: 256 x 128 bf16 each
    assert quantized_bytes(senders) == expected
    # every expert by its one holder; each o_proj half by at least one of its two DP holders, at most both
    experts = [H * 128 * 2] * 4
    assert sum(experts) + 2 * H * 128 * 2 <= sum(expected) <= sum(experts) + 4 * H * 128 * 2
    # sent D times (once per data-parallel rank of its TP rank), quantized once per sender
    attn_sent = sum(t.nbytes for t in senders.transfers() if t.name == ATTN)
    assert attn_sent == attention_dp * H * H


def test_floor_and_quantize_seconds_on_the_quantizing_gpu():
    cluster = Cluster()
    assert nic_floor(40 * 10**9, cluster) == pytest.approx(1.0)  # 40 GB through 0.8 x 50 GB/s
    train_gpu, gen_gpu = placement(2, 2, "disaggregated", 8)
    pairs = {(0, 0): 8 * 10**9, (1, 1): 4 * 10**9}
    busy = quantize_busy([16 * 10**9, 0], train_gpu, gen_gpu, cluster, bucket_bytes=1 << 29)
    fill = 2 * (1 << 29) / 128e9  # the first bucket's 512 MiB of FP8 from 1 GiB of bf16
    assert busy == pytest.approx({0: 16e9 / 128e9, 1: 0.0, 8: fill, 9: fill})
    plain = predict(pairs, train_gpu, gen_gpu, cluster, bucket_bytes=1 << 29)
    got = predict(pairs, train_gpu, gen_gpu, cluster, bucket_bytes=1 << 29, busy=busy)
    messages = math.ceil(8e9 / (1 << 29)) * 20e-6
    assert plain.seconds == pytest.approx(0.2 + messages)
    # train rank 0: 0.2 s of NIC out, then 0.125 s of quantizing counted after it (no overlap assumed)
    assert got.seconds == pytest.approx(0.2 + messages + 0.125)
    assert got.bottleneck.startswith("nic out of train rank 0") and "+ 0.125 s of trainer-side FP8" in got.bottleneck
    assert got.per_gpu[8] == pytest.approx(plain.per_gpu[8] + fill)
    with pytest.raises(ValueError, match="Cluster.quantize_gbps must be positive, got 0"):
        Cluster(quantize_gbps=0)
