import pytest

from megatron_refit.plan.gen_layout import GenLayout, ModelShape, gen_target_specs
from megatron_refit.plan.roles import param_role

HIDDEN, HEAD_DIM, FFN = 16, 4, 24
MODEL = ModelShape(num_attention_heads=8, num_kv_heads=2, vocab_size=200, num_experts=4)
L = "model.layers.0."


def boxes(params, layout, model=MODEL, style="vllm"):
    """``{gen_rank: {name: box}}``."""
    specs = gen_target_specs(params, layout, model, style=style)
    return {rank: {spec.name: spec.box for spec in rank_specs} for rank, rank_specs in specs.items()}


def rows_by_rank(name, shape, tp, model=MODEL, expert_parallel=False):
    """Dim-0 range of ``name`` on each TP rank (None where the rank holds none of it)."""
    out = boxes({name: (shape, "bfloat16")}, GenLayout(tp=tp, expert_parallel=expert_parallel), model)
    return [out[rank][name][0] if name in out[rank] else None for rank in range(tp)]


@pytest.mark.parametrize(
    "name",
    [
        L + "self_attn.q_proj.weight",
        L + "mlp.gate_proj.weight",
        L + "mlp.up_proj.weight",
        L + "mlp.shared_expert.gate_proj.weight",
        L + "mlp.shared_experts.up_proj.weight",
        L + "mlp.experts.3.gate_proj.weight",
        L + "mlp.experts.0.up_proj.weight",
    ],
)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_parallel_dim0(name, tp):
    shape = (32, HIDDEN)
    out = boxes({name: (shape, "float32")}, GenLayout(tp=tp))
    for rank in range(tp):
        step = 32 // tp
        assert out[rank][name] == ((rank * step, (rank + 1) * step), (0, HIDDEN))


@pytest.mark.parametrize("name", [L + "self_attn.q_proj.bias", L + "mlp.gate_proj.bias"])
def test_column_parallel_bias(name):
    assert rows_by_rank(name, (32,), 4) == [(0, 8), (8, 16), (16, 24), (24, 32)]


@pytest.mark.parametrize(
    "name",
    [
        L + "self_attn.o_proj.weight",
        L + "mlp.down_proj.weight",
        L + "mlp.shared_expert.down_proj.weight",
        L + "mlp.experts.2.down_proj.weight",
    ],
)
def test_row_parallel_dim1(name):
    out = boxes({name: ((HIDDEN, 32), "float32")}, GenLayout(tp=4))
    assert [out[rank][name] for rank in range(4)] == [((0, HIDDEN), (r * 8, r * 8 + 8)) for r in range(4)]


@pytest.mark.parametrize(
    "name", [L + "self_attn.o_proj.bias", L + "mlp.down_proj.bias", L + "mlp.experts.1.down_proj.bias"]
)
def test_row_parallel_bias_replicated(name):
    assert rows_by_rank(name, (HIDDEN,), 4) == [(0, HIDDEN)] * 4


@pytest.mark.parametrize(
    "name, shape",
    [
        (L + "mlp.gate.weight", (4, HIDDEN)),  # MoE router, not gate_proj
        (L + "mlp.shared_expert_gate.weight", (1, HIDDEN)),
        (L + "input_layernorm.weight", (HIDDEN,)),
        (L + "self_attn.q_norm.weight", (HEAD_DIM,)),
        (L + "self_attn.k_norm.weight", (HEAD_DIM,)),
        (L + "mlp.gate.e_score_correction_bias", (4,)),
        ("model.norm.weight", (HIDDEN,)),
        ("model.some_new_thing.scale", (3,)),
    ],
)
def test_replicated(name, shape):
    out = boxes({name: (shape, "float32")}, GenLayout(tp=4, dp=2))
    assert all(out[rank][name] == tuple((0, s) for s in shape) for rank in range(8))


def test_router_is_not_gate_proj():
    assert param_role(L + "mlp.gate.weight", 2) == "replicated"
    assert param_role(L + "mlp.gate_proj.weight", 2) == "column"


def test_q_heads_must_divide():
    with pytest.raises(ValueError, match=r"q_proj.*num_attention_heads=6.*tp=4"):
        rows_by_rank(
            L + "self_attn.q_proj.weight",
            (24, HIDDEN),
            4,
            ModelShape(num_attention_heads=6, num_kv_heads=2, vocab_size=8),
        )


@pytest.mark.parametrize("proj", ["k_proj", "v_proj"])
def test_kv_split(proj):
    model = ModelShape(num_attention_heads=8, num_kv_heads=4, vocab_size=8)
    rows = 4 * HEAD_DIM
    assert rows_by_rank(f"{L}self_attn.{proj}.weight", (rows, HIDDEN), 2, model) == [(0, 8), (8, 16)]
    assert rows_by_rank(f"{L}self_attn.{proj}.bias", (rows,), 4, model) == [(0, 4), (4, 8), (8, 12), (12, 16)]


@pytest.mark.parametrize("proj", ["k_proj", "v_proj"])
def test_kv_replication(proj):
    """tp=4 over 2 KV heads: ranks 0,1 hold head 0 and ranks 2,3 head 1 (vLLM's QKVParallelLinear)."""
    got = rows_by_rank(f"{L}self_attn.{proj}.weight", (2 * HEAD_DIM, HIDDEN), 4)
    assert got == [(0, 4), (0, 4), (4, 8), (4, 8)]
    got = rows_by_rank(f"{L}self_attn.{proj}.weight", (2 * HEAD_DIM, HIDDEN), 8)
    assert got == [(0, 4)] * 4 + [(4, 8)] * 4


def test_kv_errors():
    name = L + "self_attn.k_proj.weight"
    model = ModelShape(num_attention_heads=12, num_kv_heads=3, vocab_size=8)
    with pytest.raises(ValueError, match=r"k_proj.*num_kv_heads=3 is not divisible by tp=2"):
        rows_by_rank(name, (12, HIDDEN), 2, model)
    with pytest.raises(ValueError, match=r"k_proj.*tp=4 is not a multiple of num_kv_heads=3"):
        rows_by_rank(name, (12, HIDDEN), 4, model)


@pytest.mark.parametrize("name", ["model.embed_tokens.weight", "lm_head.weight"])
def test_vocab_padding(name):
    # 200 rows pad to 256; 64 per rank at tp=4: the last rank holds the uneven tail [192, 200).
    assert rows_by_rank(name, (200, HIDDEN), 4) == [(0, 64), (64, 128), (128, 192), (192, 200)]
    # 100 rows pad to 128, 16 per rank at tp=8: rank 7 would start at 112 >= 100 and holds nothing.
    model = ModelShape(num_attention_heads=8, num_kv_heads=2, vocab_size=100)
    assert rows_by_rank(name, (100, HIDDEN), 8, model) == [
        (0, 16),
        (16, 32),
        (32, 48),
        (48, 64),
        (64, 80),
        (80, 96),
        (96, 100),
        None,
    ]


def test_vocab_errors():
    with pytest.raises(ValueError, match=r"embed_tokens.*201 rows but vocab_size=200"):
        rows_by_rank("model.embed_tokens.weight", (201, HIDDEN), 2)
    with pytest.raises(ValueError, match=r"lm_head.*padded vocab 256 is not divisible by tp=3"):
        rows_by_rank(
            "lm_head.weight", (200, HIDDEN), 3, ModelShape(num_attention_heads=3, num_kv_heads=3, vocab_size=200)
        )


def test_experts_tp_sharded_without_ep():
    params = {
        f"{L}mlp.experts.{e}.{p}.weight": ((FFN, HIDDEN) if p != "down_proj" else (HIDDEN, FFN), "bfloat16")
        for e in range(4)
        for p in ("gate_proj", "up_proj", "down_proj")
    }
    out = boxes(params, GenLayout(tp=2))
    for rank in range(2):
        assert len(out[rank]) == 12
        assert out[rank][f"{L}mlp.experts.3.up_proj.weight"] == ((rank * 12, rank * 12 + 12), (0, HIDDEN))
        assert out[rank][f"{L}mlp.experts.1.down_proj.weight"] == ((0, HIDDEN), (rank * 12, rank * 12 + 12))


def test_experts_ep_split():
    params = {
        f"{L}mlp.experts.{e}.{p}": ((FFN, HIDDEN) if p == "up_proj.weight" else (HIDDEN,), "bfloat16")
        for e in range(4)
        for p in ("up_proj.weight", "down_proj.bias")
    }
    params[L + "mlp.gate.weight"] = ((4, HIDDEN), "float32")
    specs = gen_target_specs(params, GenLayout(tp=2, dp=2, expert_parallel=True), MODEL)
    for rank in range(4):
        tp_rank = rank % 2
        held = {spec.name: spec for spec in specs[rank]}
        experts = {int(n.split(".")[5]) for n in held if ".experts." in n}
        assert experts == {2 * tp_rank, 2 * tp_rank + 1}
        assert all(spec.box == tuple((0, s) for s in spec.global_shape) for spec in held.values())
        assert all(spec.is_expert == (".experts." in spec.name) for spec in held.values())
        assert L + "mlp.gate.weight" in held


def test_ep_errors():
    name = L + "mlp.experts.0.up_proj.weight"
    with pytest.raises(ValueError, match=r"experts\.0.*num_experts=4 is not a positive multiple of tp=3"):
        rows_by_rank(
            name,
            (FFN, HIDDEN),
            3,
            ModelShape(num_attention_heads=3, num_kv_heads=3, vocab_size=8, num_experts=4),
            expert_parallel=True,
        )
    with pytest.raises(ValueError, match=r"experts\.9.*out of range for num_experts=4"):
        rows_by_rank(L + "mlp.experts.9.up_proj.weight", (FFN, HIDDEN), 2, expert_parallel=True)


def test_dp_replicas_match_dp0():
    params = {
        L + "self_attn.q_proj.weight": ((32, HIDDEN), "float32"),
        "model.embed_tokens.weight": ((200, HIDDEN), "float32"),
    }
    out = boxes(params, GenLayout(tp=2, dp=3))
    assert sorted(out) == list(range(6))
    for rank in range(6):
        assert out[rank] == out[rank % 2]


def test_full_style():
    params = {L + "self_attn.q_proj.weight": ((32, HIDDEN), "float32"), "weird.tensor": ((3, 4, 5), "bfloat16")}
    specs = gen_target_specs(params, GenLayout(dp=2), MODEL, style="full")
    for rank in range(2):
        assert [(s.name, s.box, s.dtype) for s in specs[rank]] == [
            (L + "self_attn.q_proj.weight", ((0, 32), (0, HIDDEN)), "float32"),
            ("weird.tensor", ((0, 3), (0, 4), (0, 5)), "bfloat16"),
        ]
    with pytest.raises(ValueError, match=r"style='full'.*tp=2"):
        gen_target_specs(params, GenLayout(tp=2), MODEL, style="full")


def test_errors_name_culprit():
    with pytest.raises(ValueError, match=r"no vLLM sharding rule for parameter 'model.layers.0.mlp.mystery.weight'"):
        boxes({L + "mlp.mystery.weight": ((4, 4), "float32")}, GenLayout(tp=2))
    with pytest.raises(ValueError, match=r"gate_proj.*size 30 is not divisible by tp=4"):
        boxes({L + "mlp.gate_proj.weight": ((30, 4), "float32")}, GenLayout(tp=4))
    with pytest.raises(ValueError, match=r"o_proj.*size 30 is not divisible by tp=4"):
        boxes({L + "self_attn.o_proj.weight": ((4, 30), "float32")}, GenLayout(tp=4))
    with pytest.raises(ValueError, match=r"unknown gen style 'sglang'"):
        boxes({}, GenLayout(), style="sglang")


@pytest.mark.parametrize("kwargs, field", [({"tp": 0}, "tp"), ({"dp": -1}, "dp"), ({"tp": 1.5}, "tp")])
def test_layout_validation(kwargs, field):
    with pytest.raises(ValueError, match=rf"GenLayout\.{field}"):
        GenLayout(**kwargs)


def test_model_shape_validation():
    with pytest.raises(ValueError, match=r"ModelShape\.num_kv_heads"):
        ModelShape(num_attention_heads=8, num_kv_heads=0, vocab_size=8)
    with pytest.raises(ValueError, match=r"ModelShape\.num_experts"):
        ModelShape(num_attention_heads=8, num_kv_heads=2, vocab_size=8, num_experts=-1)
