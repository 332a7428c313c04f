"""Model families beyond Qwen3: Llama 3 (tied / untied), DeepSeek-V3 (MLA, dense first
layer, shared + routed experts, router bias). Nemotron-H: tests/megatron/test_nemotron_h.py.

Local shards of real tiny models at TP2, TP2xEP2 and uneven PP2 reassemble to Bridge's
``export_hf_weights`` bit for bit; the meta-device enumeration gives the same specs; the
full-size DeepSeek-V3 enumerates on the meta device as ranks of PP16xEP16; the end-to-end
refits (real optimizer steps) into gen TP1xDP2 (transformers) and gen TP2 (vLLM layout)
are bit-exact.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from megatron_refit.plan.gen_layout import GenLayout, ModelShape, gen_target_specs
from megatron_refit.plan.roles import param_role
from megatron_refit.local.evaluate import evaluate
from megatron_refit.local.harness import RunSpec, run
from megatron_refit.local.launch import run_spawned
from megatron_refit.plan.layout import TrainLayout
from megatron_refit.engines.fused.layout import expected_storage, fused_layout
from megatron_refit.plan.spec import intersect
from megatron_refit.testing import workers

VOCAB = 250
CASES = [
    ("llama3", dict(tp=2), True),
    ("llama3-tied", dict(tp=2), False),
    ("deepseek-v3", dict(tp=2, ep=2), False),
    ("deepseek-v3", dict(pp=2, first_stage_layers=1), False),
]
MLA_NAMES = ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")


def _layout_kw(kw, world=2):
    kw = dict(kw)
    kw.setdefault("dp", world // (kw.get("tp", 1) * kw.get("pp", 1)))
    return kw


@pytest.fixture(scope="module")
def enumerated():
    cases = [(m, _layout_kw(kw), pad) for m, kw, pad in CASES]
    return run_spawned(workers.enumerate_cases, 2, cases, timeout_s=420)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{m}-{kw}" for m, kw, _ in CASES])
def test_local_shards_reassemble_to_bridge_export(enumerated, index):
    model, kw, _ = CASES[index]
    per_rank = [r[index] for r in enumerated]
    export = per_rank[0]["export"]
    pieces: dict[str, dict] = {}
    for res in per_rank:
        assert res["meta"] == [spec for spec, _ in res["real"]]  # meta enumeration agrees
        assert res["meta_devices"] == {"meta"}
        for spec, tensor in res["real"]:
            byname = pieces.setdefault(spec.name, {})
            if spec.box in byname:
                assert torch.equal(byname[spec.box][1], tensor), f"replicas of {spec.name} differ"
            else:
                byname[spec.box] = (spec, tensor)
    expected = set(export)
    if model == "llama3-tied":  # Bridge exports the tied head as a copy; the receiver has none
        assert torch.equal(export.pop("lm_head.weight"), export["model.embed_tokens.weight"])
        expected.discard("lm_head.weight")
    assert set(pieces) == expected, set(pieces) ^ expected
    for name, boxes in pieces.items():
        specs = [s for s, _ in boxes.values()]
        ref = export[name][: specs[0].global_shape[0]] if "embed" in name or "lm_head" in name else export[name]
        assert tuple(ref.shape) == specs[0].global_shape, name
        assert sum(s.numel for s in specs) == math.prod(ref.shape), name
        assert all(intersect(a.box, b.box) is None for i, a in enumerate(specs) for b in specs[i + 1:]), name
        for spec, tensor in boxes.values():
            assert torch.equal(ref[tuple(slice(lo, hi) for lo, hi in spec.box)], tensor), (name, spec.box)
    if model.startswith("deepseek"):
        attn = {n.split(".self_attn.")[1].rsplit(".", 1)[0] for n in pieces if ".self_attn." in n}
        assert attn == set(MLA_NAMES)
        assert "model.layers.0.mlp.gate_proj.weight" in pieces  # first_k_dense_replace=1
        assert not any(n.startswith("model.layers.0.mlp.experts") for n in pieces)
        for layer in (1, 2):
            for n in ("gate.weight", "gate.e_score_correction_bias", "shared_experts.gate_proj.weight",
                      "shared_experts.up_proj.weight", "shared_experts.down_proj.weight", "experts.3.up_proj.weight"):
                assert f"model.layers.{layer}.mlp.{n}" in pieces
        bias = export["model.layers.1.mlp.gate.e_score_correction_bias"]
        assert bias.dtype == torch.float32 and bias.abs().sum() > 0
    else:
        assert not any("q_norm" in n or "k_norm" in n for n in pieces)  # Llama: no QK norm
    if kw.get("ep"):
        for rank, res in enumerate(per_rank):
            experts = {int(m) for s, _ in res["real"] for m in re.findall(r"\.experts\.(\d+)\.", s.name)}
            assert experts == {2 * rank, 2 * rank + 1}
            assert res["grouped"] and all(s.global_shape[0] == 4 for s, _ in res["grouped"])
    if kw.get("pp"):  # uneven: stage 0 holds layer 0 only, stage 1 layers 1-2 and the head
        layers = [{int(s.name.split(".")[2]) for s, _ in res["real"] if ".layers." in s.name} for res in per_rank]
        assert layers == [{0}, {1, 2}]


def _fake_world_specs(rank, world_size, port):
    """Full-size DeepSeek-V3 ranks of PP16xEP16, and every rank of the tiny CASES, each
    built on the meta device in a fake process group (one process)."""
    import time

    from conversion.presets import hf_config
    from conversion.testing.meta import peak_rss_mb, rank_shard_specs

    layout = TrainLayout(pp=16, ep=16, dp=16, first_stage_layers=3, last_stage_layers=2)
    cfg = hf_config("deepseek-v3-671b")
    start = time.perf_counter()
    full = {r: rank_shard_specs(cfg, layout, r) for r in (0, 21, 255)}
    seconds = time.perf_counter() - start
    tiny = [[rank_shard_specs(hf_config(m), TrainLayout(**_layout_kw(kw)), r) for r in range(2)]
            for m, kw, pad in CASES if not pad]
    return full, seconds, peak_rss_mb(), tiny, _bf16_dtypes()


def _bf16_dtypes():
    """dtype per HF name of a bf16 DeepSeek-V3 (meta, TP2xEP2 rank 0)."""
    from conversion.testing.build import (
        build_model,
        destroy_model_parallel,
        init_model_parallel,
    )
    from conversion.presets import hf_config
    from conversion.local_shards import enumerate_local_shards
    from conversion.testing.meta import fake_world

    layout = TrainLayout(tp=2, ep=2)
    cfg = hf_config("deepseek-v3")
    with fake_world(0, 2):
        init_model_parallel(layout, create_gloo_process_groups=False)
        try:
            built = build_model(cfg, layout, meta=True, dtype=torch.bfloat16)
            return {s.spec.name: s.spec.dtype for s in enumerate_local_shards(built.bridge, built.model, cfg)}
        finally:
            destroy_model_parallel()


@pytest.mark.slow
def test_bf16_router_bias_stays_float32_on_both_ends(fake_world_specs):
    """Megatron's router keeps expert_bias in float32 (and restores it on every forward);
    transformers and vLLM hold e_score_correction_bias in float32 too."""
    from conversion.presets import hf_config
    from megatron_refit.engines.hf.storage import HFStorage

    train = fake_world_specs[4]
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert train[bias] == "float32" and train["model.layers.1.self_attn.q_b_proj.weight"] == "bfloat16"
    receiver = HFStorage.from_config(hf_config("deepseek-v3"), dtype=torch.bfloat16)
    gen = {s.name: s.dtype for s in receiver.target_specs()}
    assert gen[bias] == "float32" and gen["model.layers.1.self_attn.q_b_proj.weight"] == "bfloat16"


@pytest.fixture(scope="module")
def fake_world_specs():
    return run_spawned(_fake_world_specs, 1, timeout_s=300)[0]


@pytest.mark.slow
def test_fake_world_specs_equal_real_ranks(enumerated, fake_world_specs):
    tiny = fake_world_specs[3]
    indices = [i for i, (_, _, pad) in enumerate(CASES) if not pad]
    for index, per_rank in zip(indices, tiny, strict=True):
        for rank in range(2):
            assert per_rank[rank] == [spec for spec, _ in enumerated[rank][index]["real"]], (CASES[index], rank)


@pytest.mark.slow
def test_deepseek_v3_full_size_meta_ranks_of_pp16_ep16(fake_world_specs):
    specs, seconds, rss_mb = fake_world_specs[:3]
    print(f"\nDeepSeek-V3 PP16xEP16 ranks 0/21/255: {seconds:.1f} s, peak RSS {rss_mb:.0f} MB")
    assert rss_mb < 2048

    def layers(rank):
        return {int(s.name.split(".")[2]) for s in specs[rank] if ".layers." in s.name}

    assert layers(0) == {0, 1, 2} and layers(21) == {3, 4, 5, 6} and layers(255) == {59, 60}
    names0 = {s.name for s in specs[0]}
    assert "model.embed_tokens.weight" in names0 and not any(s.is_expert for s in specs[0])  # dense layers
    kv_a = next(s for s in specs[0] if s.name == "model.layers.0.self_attn.kv_a_proj_with_mqa.weight")
    assert kv_a.global_shape == (512 + 64, 7168) and kv_a.shape == kv_a.global_shape
    q_b = next(s for s in specs[0] if s.name == "model.layers.0.self_attn.q_b_proj.weight")
    assert q_b.global_shape == (128 * (128 + 64), 1536)
    # rank 21: pp stage 1, ep rank 5 -> experts 80..95 of layers 3-6
    experts = {int(s.name.split(".experts.")[1].split(".")[0]) for s in specs[21] if s.is_expert}
    assert experts == set(range(80, 96))
    assert "model.layers.3.mlp.gate.e_score_correction_bias" in {s.name for s in specs[21]}
    assert {s.pp_stage for s in specs[255]} == {15} and "lm_head.weight" in {s.name for s in specs[255]}


# Each case spawns 4 processes (~35-70 s on 2 busy cores).
E2E = [
    ("llama3-tied", TrainLayout(tp=2), GenLayout(tp=1, dp=2)),
    # Llama untied into vLLM TP2 uses Qwen3's rules (covered there); its local shards are checked above.
    ("deepseek-v3", TrainLayout(tp=2, ep=2), GenLayout(tp=1, dp=2)),
    ("deepseek-v3", TrainLayout(tp=2, ep=2), GenLayout(tp=2)),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", E2E, ids=[f"{m}-{t.describe()}-genTP{g.tp}xDP{g.dp}" for m, t, g in E2E])
def test_refit_bit_exact(case):
    model, train, gen = case
    spec = RunSpec(model=model, train=train, gen=gen, refits=2, bucket_bytes=64 << 10)
    result = evaluate(spec, run(spec))
    assert result["bit_exact"] is True
    for r in result["refits"]:
        assert r["bytes_sent"] == r["bytes_minimal"] > 0
    if gen.tp == 1:
        assert result["max_logit_diff"] is not None and result["max_logit_diff"] <= 1e-5
    assert result["refits"][0]["loss"] != result["refits"][1]["loss"]


# --- pure: vLLM sharding of the new names --------------------------------------------------

L = "model.layers.1."
DSV3 = ModelShape(num_attention_heads=4, num_kv_heads=4, vocab_size=VOCAB, num_experts=4)


@pytest.mark.parametrize("name,ndim,role", [
    (L + "self_attn.q_a_proj.weight", 2, "replicated"),
    (L + "self_attn.kv_a_proj_with_mqa.weight", 2, "replicated"),
    (L + "self_attn.q_b_proj.weight", 2, "q"),
    (L + "self_attn.kv_b_proj.weight", 2, "q"),
    (L + "self_attn.o_proj.weight", 2, "row"),
    (L + "self_attn.q_a_layernorm.weight", 1, "replicated"),
    (L + "self_attn.kv_a_layernorm.weight", 1, "replicated"),
    (L + "mlp.gate.e_score_correction_bias", 1, "replicated"),
    (L + "mlp.shared_experts.gate_proj.weight", 2, "column"),
    (L + "mlp.shared_experts.down_proj.weight", 2, "row"),
])
def test_mla_and_shared_expert_roles(name, ndim, role):
    assert param_role(name, ndim) == role


def _mla_params():
    p = {
        L + "self_attn.q_a_proj.weight": (24, 64),
        L + "self_attn.kv_a_proj_with_mqa.weight": (24, 64),
        L + "self_attn.q_b_proj.weight": (4 * 16, 24),
        L + "self_attn.kv_b_proj.weight": (4 * 16, 16),
        L + "self_attn.o_proj.weight": (64, 4 * 8),
        L + "mlp.shared_experts.gate_proj.weight": (32, 64),
        L + "mlp.shared_experts.up_proj.weight": (32, 64),
        L + "mlp.shared_experts.down_proj.weight": (64, 32),
    }
    return {n: (s, "float32") for n, s in p.items()}


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vllm_mla_layout(tp):
    """vLLM DeepseekV2 with q_lora_rank: replicated fused_qkv_a_proj = [q_a; kv_a_with_mqa];
    q_b / kv_b column by heads; o_proj row; shared experts' gate_up_proj column."""
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s, generator=g) for n, (s, _) in _mla_params().items()}
    specs = gen_target_specs(_mla_params(), GenLayout(tp=tp), DSV3)
    for r in range(tp):
        got = expected_storage(full, specs[r], DSV3, tp)
        a = L + "self_attn."
        assert torch.equal(got[a + "fused_qkv_a_proj.weight"],
                           torch.cat([full[a + "q_a_proj.weight"], full[a + "kv_a_proj_with_mqa.weight"]]))
        rows = 64 // tp
        for proj in ("q_b_proj", "kv_b_proj"):
            assert torch.equal(got[a + f"{proj}.weight"], full[a + f"{proj}.weight"][r * rows:(r + 1) * rows])
        assert torch.equal(got[a + "o_proj.weight"], full[a + "o_proj.weight"][:, r * 32 // tp:(r + 1) * 32 // tp])
        m = L + "mlp.shared_experts."
        f = 32 // tp
        assert torch.equal(got[m + "gate_up_proj.weight"],
                           torch.cat([full[m + "gate_proj.weight"][r * f:(r + 1) * f],
                                      full[m + "up_proj.weight"][r * f:(r + 1) * f]]))
    shapes, _ = fused_layout(specs[0], DSV3, tp)
    assert shapes[L + "self_attn.fused_qkv_a_proj.weight"][0] == (48, 64)


def test_mla_heads_not_divisible_by_gen_tp():
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by tp=8"):
        gen_target_specs(_mla_params(), GenLayout(tp=8), DSV3)


def test_uneven_pipeline_stages():
    layout = TrainLayout(pp=16, ep=16, dp=16, first_stage_layers=3, last_stage_layers=2)
    assert layout.stage_layers(61) == [3] + [4] * 14 + [2]
    assert TrainLayout(pp=2, first_stage_layers=1).stage_layers(3) == [1, 2]
    with pytest.raises(ValueError, match="num_layers=60 does not split over pipeline_model_parallel_size=16"):
        layout.stage_layers(60)
    with pytest.raises(ValueError, match="first_stage_layers"):
        TrainLayout(first_stage_layers=3)


def test_presets_and_unsupported_family():
    from conversion.testing.families import family
    from conversion.presets import hf_config, num_routed_experts

    assert hf_config("llama3").tie_word_embeddings is False and hf_config("llama3-tied").tie_word_embeddings
    full = hf_config("deepseek-v3-671b")
    assert (full.hidden_size, full.num_hidden_layers, full.n_routed_experts, full.vocab_size) == (7168, 61, 256, 129280)
    assert num_routed_experts(full) == 256 and num_routed_experts(hf_config("llama3")) == 0
    assert hf_config("deepseek-v3", experts=8).n_routed_experts == 8
    assert family(hf_config("nemotron-h")) == "nemotron_h"
    nano = hf_config("nemotron-3-nano-30b-a3b")
    assert [nano.layers_block_type.count(k) for k in ("mamba", "moe", "attention")] == [23, 23, 6]
    unknown = hf_config("qwen3")
    unknown.architectures = ["MysteryForCausalLM"]
    with pytest.raises(ValueError, match="unsupported architecture 'MysteryForCausalLM'"):
        family(unknown)

