"""Blockwise FP8 reference math: bit-exact on the conventions and edge cases of STYLE.md."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_refit.endpoint.fp8 import FP8_DTYPE, dequantize_blockwise, quantize_blockwise
from megatron_refit.plan.fp8_layout import fp8_param_table, fp8_specs, is_quantized, scale_box, scale_shape
from megatron_refit.plan.spec import ShardSpec

SHAPES = [1, 127, 128, 129, 300]
BLOCKS = [(128, 128), (1, 128)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous().view(torch.int32)


def _reference(x: torch.Tensor, block, pow2: bool):
    """Block by block with scalar arithmetic, no padding: an independent formulation."""
    rows, cols = math.ceil(x.shape[0] / block[0]), math.ceil(x.shape[1] / block[1])
    q = torch.empty(x.shape, dtype=FP8_DTYPE)
    s = torch.empty(rows, cols, dtype=torch.float32)
    for i in range(rows):
        for j in range(cols):
            sl = (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
            tile = x[sl].float()
            amax = tile.abs().max()
            if amax == 0:
                scale = torch.tensor(1.0)
            else:
                scale = torch.tensor(448.0, dtype=torch.float32) / amax
                if torch.isinf(scale):
                    scale = torch.tensor(torch.finfo(torch.float32).max)
                if pow2:
                    scale = torch.tensor(2.0 ** math.floor(math.log2(scale.item())), dtype=torch.float32)
            q[sl] = torch.clamp(tile * scale, -448.0, 448.0).to(FP8_DTYPE)
            s[i, j] = 1.0 / scale
    return q, s


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("rows", SHAPES)
@pytest.mark.parametrize("cols", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_matches_blockwise_reference(rows, cols, block, pow2, dtype):
    g = torch.Generator().manual_seed(rows * 1000 + cols)
    x = (torch.randn(rows, cols, generator=g) * torch.logspace(-3, 3, cols)).to(dtype)
    q, s = quantize_blockwise(x, block, pow2_scales=pow2)
    rq, rs = _reference(x, block, pow2)
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32
    assert tuple(q.shape) == (rows, cols) and tuple(s.shape) == scale_shape((rows, cols), block)
    assert torch.equal(_bits(q), _bits(rq))
    assert torch.equal(_bits(s), _bits(rs))
    assert not torch.isnan(q.float()).any()
    if pow2:
        mantissa, _ = torch.frexp(s)
        assert torch.all(mantissa == 0.5), "pow2 scales must be exact powers of two"


def test_edge_values():
    x = torch.zeros(256, 256)
    x[:128, 128:] = torch.linspace(-3.0, 7.0, 128 * 128).view(128, 128)  # block (0, 1): max 7
    x[128:, :128] = torch.finfo(torch.bfloat16).max  # bf16 max
    x[128:, 128:] = torch.full((128, 128), 1e-45)  # float32 subnormal: scale would be inf
    q, s = quantize_blockwise(x)
    assert torch.all(q[:128, :128].float() == 0) and s[0, 0] == 1.0  # zero block
    assert q[:128, 128:].float().max() == 448.0  # the block max quantizes to +448
    assert q[:128, 128:].float().min() == pytest.approx(-3.0 * 448.0 / 7.0, rel=0.07)
    assert torch.all(q[128:, :128].float() == 448.0)
    assert s[1, 1] == 1.0 / torch.finfo(torch.float32).max  # inf scale → float32 max
    assert not torch.isnan(q.float()).any() and torch.isfinite(s).all()
    neg = quantize_blockwise(-x)[0]
    assert neg[:128, 128:].float().min() == -448.0


def test_clamp_prevents_nan():
    # x * scale can round above 448 in float32; without the clamp the cast gives NaN
    x = torch.tensor([[448.0, 448.0 + 2**-15]], dtype=torch.float32)
    q, _ = quantize_blockwise(x)
    assert not torch.isnan(q.float()).any()


@pytest.mark.parametrize("pow2", [False, True])
def test_dequantize_round_trip_error(pow2):
    x = torch.randn(300, 129, generator=torch.Generator().manual_seed(0))
    q, s = quantize_blockwise(x, pow2_scales=pow2)
    back = dequantize_blockwise(q, s)
    assert back.shape == x.shape
    # e4m3: 3 mantissa bits → relative error ≤ 2**-4 of the block max per element
    for i in range(3):
        for j in range(2):
            tile = (slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128))
            assert (back[tile] - x[tile]).abs().max() <= x[tile].abs().max() * 2**-4 * (2 if pow2 else 1)
    if pow2:  # power-of-two scales make quantize ∘ dequantize idempotent
        again = quantize_blockwise(back, pow2_scales=True)
        assert torch.equal(_bits(dequantize_blockwise(*again)), _bits(back))


@pytest.mark.parametrize("start,stop,aligned", [(0, 128, True), (128, 300, True), (128, 256, True),
                                                (0, 129, False), (64, 192, False)])
def test_quantizing_a_shard_equals_slicing_iff_aligned(start, stop, aligned):
    w = torch.randn(300, 256, generator=torch.Generator().manual_seed(1))
    q, s = quantize_blockwise(w)
    sq, ss = quantize_blockwise(w[start:stop])
    tiles = (start // 128, math.ceil(stop / 128))
    same = torch.equal(_bits(sq), _bits(q[start:stop])) and torch.equal(_bits(ss), _bits(s[tiles[0]:tiles[1]]))
    assert same is aligned


def test_dequantize_rejects_bad_input():
    q, s = quantize_blockwise(torch.randn(130, 10))
    with pytest.raises(ValueError, match=r"scale_inv shape \(1, 1\)"):
        dequantize_blockwise(q, s[:1])
    with pytest.raises(ValueError, match="float8_e4m3fn data"):
        dequantize_blockwise(q.float(), s)
    with pytest.raises(ValueError, match="2-D"):
        quantize_blockwise(torch.randn(4))


def test_selection_by_role():
    quantized = [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.1.mlp.experts.7.gate_proj.weight",
        "model.layers.1.mlp.experts.7.down_proj.weight",
        "model.layers.1.mlp.shared_experts.up_proj.weight",
    ]
    kept = [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.layers.1.mlp.gate.weight",  # the MoE router: a "gate" substring rule would catch it
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_norm.weight",
    ]
    for name in quantized:
        assert is_quantized(name, (256, 256)), name
    for name in kept:
        assert not is_quantized(name, (256, 256) if "norm" not in name and "bias" not in name else (256,)), name


def test_fp8_specs_and_scale_boxes():
    spec = ShardSpec(name="m.q_proj.weight", global_shape=(512, 300), dtype="bfloat16", box=((256, 512), (0, 300)))
    weight, scale = fp8_specs(spec)
    assert weight.dtype == "float8_e4m3fn" and weight.box == spec.box
    assert scale.name == "m.q_proj.weight_scale_inv" and scale.global_shape == (4, 3)
    assert scale.box == ((2, 4), (0, 3)) and scale.dtype == "float32"
    with pytest.raises(ValueError, match=r"m.o_proj.weight: shard boundary 150 in dim 1 \(size 300\)"):
        scale_box("m.o_proj.weight", ((0, 512), (0, 150)), (512, 300))
    table = fp8_param_table({"a.self_attn.v_proj.weight": ((256, 64), "bfloat16"), "norm.weight": ((64,), "bfloat16")})
    assert table == {"a.self_attn.v_proj.weight": ((256, 64), "float8_e4m3fn"),
                     "a.self_attn.v_proj.weight_scale_inv": ((2, 1), "float32"),
                     "norm.weight": ((64,), "bfloat16")}
