"""FP8 tiles through the plan: random 128-aligned train and gen tilings of quantized weights;
replaying the plan on trainer-quantized pieces reproduces quantizing the full tensor."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_refit.endpoint.bytes import replay
from megatron_refit.endpoint.sender import TensorPiece
from megatron_refit.plan.fp8_layout import BLOCK, fp8_param_table, fp8_specs
from megatron_refit.endpoint.fp8 import quantize_blockwise
from megatron_refit.endpoint.fp8_pieces import quantize_pieces
from megatron_refit.plan.gen_layout import GenLayout, ModelShape, gen_target_specs
from megatron_refit.plan.refit_plan import RefitPlan
from megatron_refit.plan.spec import Box, ShardSpec, full_box

pytestmark = pytest.mark.reliability

NAMES = ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.self_attn.o_proj.weight"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


@st.composite
def aligned_tilings(draw, shape: tuple[int, int]) -> list[Box]:
    """A partition of ``shape`` along one dim, cut only on the 128 grid."""
    dim = draw(st.sampled_from([0, 1]))
    tiles = -(-shape[dim] // BLOCK)
    cuts = draw(st.sets(st.integers(1, tiles - 1))) if tiles > 1 else set()
    edges = [0, *sorted(c * BLOCK for c in cuts), shape[dim]]
    return [tuple((a, b) if d == dim else (0, shape[d]) for d in range(2)) for a, b in itertools.pairwise(edges)]


@st.composite
def problems(draw):
    params = {}
    for name in draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=2, unique=True)):
        params[name] = tuple(draw(st.integers(1, 3)) * BLOCK - draw(st.sampled_from([0, 0, 28, 127])) for _ in range(2))
    train: dict[int, list] = {}
    gen: dict[int, list[ShardSpec]] = {}
    full = {}
    rng = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    for name, shape in params.items():
        full[name] = torch.randn(shape, generator=rng) * 10 ** torch.randint(-3, 4, (1,), generator=rng).item()
        for rank, box in enumerate(b for b in draw(aligned_tilings(shape)) for _ in range(draw(st.integers(1, 2)))):
            spec = ShardSpec(name=name, global_shape=shape, dtype="float32", box=box)
            train.setdefault(rank, []).append(TensorPiece(spec, full[name][_slices(box)].clone()))
        for rank, box in enumerate(b for b in draw(aligned_tilings(shape)) for _ in range(draw(st.integers(1, 2)))):
            spec = ShardSpec(name=name, global_shape=shape, dtype="float32", box=box)
            gen.setdefault(rank, []).extend(fp8_specs(spec))
    return train, gen, full, draw(st.sampled_from([1, 100, 4096, 1 << 20]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_plan_on_quantized_pieces_equals_quantizing_the_full_tensor(problem):
    train, gen, full, bucket_bytes = problem
    pieces = {rank: quantize_pieces(ps) for rank, ps in train.items()}
    plan = RefitPlan.build({r: [p.spec for p in ps] for r, ps in pieces.items()}, gen, bucket_bytes=bucket_bytes)
    got = replay(plan, {r: {p.spec.name: p.tensor() for p in ps} for r, ps in pieces.items()})
    for rank, specs in gen.items():
        for spec in specs:
            weight = spec.name.removesuffix("_scale_inv")
            q, s = quantize_blockwise(full[weight])
            want = (s if spec.name.endswith("_scale_inv") else q)[_slices(spec.box)]
            assert torch.equal(_bits(got[rank][spec.name]), _bits(want)), (rank, spec)
    assert plan.bytes_sent == plan.bytes_minimal


@pytest.mark.parametrize("box,dim,edge", [(((0, 200), (0, 256)), 0, 200), (((0, 256), (64, 256)), 1, 64)])
def test_train_shard_off_the_128_grid_is_refused(box, dim, edge):
    spec = ShardSpec(name=NAMES[0], global_shape=(256, 256), dtype="bfloat16", box=box)
    piece = TensorPiece(spec, torch.zeros(spec.shape))
    with pytest.raises(ValueError, match=rf"{NAMES[0]}: shard boundary {edge} in dim {dim} \(size 256\)"):
        quantize_pieces([piece])


def test_gen_shard_off_the_128_grid_is_refused():
    # o_proj [256, 320] over gen TP2: each rank holds 160 input columns, off the grid
    params = fp8_param_table({"model.layers.0.self_attn.o_proj.weight": ((256, 320), "bfloat16")})
    model = ModelShape(num_attention_heads=2, num_kv_heads=2, vocab_size=128)
    with pytest.raises(ValueError, match=r"o_proj.weight: shard boundary 160 in dim 1 \(size 320\)"):
        gen_target_specs(params, GenLayout(tp=2), model)
    ok = gen_target_specs(params, GenLayout(tp=1, dp=2), model)
    assert [s.box for s in ok[1]] == [full_box((256, 320)), full_box((2, 3))]


def test_fp8_pieces_are_released_and_requantized():
    spec = ShardSpec(name=NAMES[0], global_shape=(256, 128), dtype="float32", box=full_box((256, 128)))
    released = []

    class Piece(TensorPiece):
        def release(self):
            released.append(True)

    data = torch.randn(256, 128)
    weight, scale = quantize_pieces([Piece(spec, data)])
    q1 = weight.tensor()
    weight.release()
    assert not released  # the scale part is still held
    assert scale.tensor() is scale.tensor()
    scale.release()
    assert released == [True]  # both parts gone: the source piece is released too
    data.copy_(torch.randn(256, 128))  # the next refit quantizes the new values
    assert not torch.equal(_bits(weight.tensor()), _bits(q1))


def test_an_mtp_piece_passes_unquantized():
    """DeepSeek-V3's MTP layer: an optional piece (no engine's main model holds it; skipped by name)
    passes trainer-side FP8 as it is, and its ``eh_proj`` is whole and unquantized in the engines'
    drafts (a plain ``nn.Linear`` in vLLM's DeepSeekMTP and SGLang's NextN) where one holds it (#67)."""
    mtp = ShardSpec(name="model.layers.61.eh_proj.weight", global_shape=(256, 512), dtype="bfloat16",
                    box=full_box((256, 512)))
    required = TensorPiece(mtp, torch.zeros(mtp.shape))
    assert quantize_pieces([required]) == [required]
    piece = TensorPiece(mtp, torch.zeros(mtp.shape), optional="mtp")
    assert quantize_pieces([piece]) == [piece]
    with pytest.raises(ValueError, match="no vLLM sharding rule for parameter 'model.layers.61.xy_proj.weight'"):
        spec = ShardSpec(name="model.layers.61.xy_proj.weight", global_shape=(256, 512), dtype="bfloat16",
                         box=full_box((256, 512)))
        quantize_pieces([TensorPiece(spec, torch.zeros(spec.shape))])  # a 2-D name no rule knows is refused


def test_bf16_trainer_into_fp8_engine_is_refused_with_a_hint():
    from megatron_refit.errors import PlanError

    table = {NAMES[0]: ((256, 256), "bfloat16")}
    model = ModelShape(num_attention_heads=2, num_kv_heads=2, vocab_size=128)
    gen = gen_target_specs(fp8_param_table(table), GenLayout(tp=1), model)
    train = {0: [ShardSpec(name=NAMES[0], global_shape=(256, 256), dtype="bfloat16", box=full_box((256, 256)))]}
    with pytest.raises(PlanError, match=r"gate_proj.weight: dtype float8_e4m3fn on gen ranks, bfloat16 on train "
                                        r"ranks: the engine loads block-FP8 weights; turn on trainer-side FP8"):
        RefitPlan.build(train, gen)
