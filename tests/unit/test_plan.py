import random

import pytest
import torch

from megatron_refit.endpoint.bytes import pack_bucket, repack_bucket, replay, unpack_bucket
from megatron_refit.plan.gen_layout import GenLayout, ModelShape, gen_target_specs
from megatron_refit.plan.buckets import ALIGN
from megatron_refit.plan.refit_plan import RefitPlan
from megatron_refit.errors import PlanError
from megatron_refit.plan.spec import ShardSpec, box_along, full_box

HIDDEN, HEAD_DIM, FFN, VOCAB = 8, 2, 12, 100
MODEL = ModelShape(num_attention_heads=4, num_kv_heads=2, vocab_size=VOCAB)
L = "model.layers.0."
# name -> (shape, dtype, train TP dim or None for replicated)
PARAMS = {
    "model.embed_tokens.weight": ((VOCAB, HIDDEN), "float32", 0),
    L + "self_attn.q_proj.weight": ((4 * HEAD_DIM, HIDDEN), "bfloat16", 0),
    L + "self_attn.k_proj.weight": ((2 * HEAD_DIM, HIDDEN), "bfloat16", 0),
    L + "self_attn.v_proj.weight": ((2 * HEAD_DIM, HIDDEN), "bfloat16", 0),
    L + "self_attn.o_proj.weight": ((HIDDEN, 4 * HEAD_DIM), "bfloat16", 1),
    L + "mlp.gate_proj.weight": ((FFN, HIDDEN), "float32", 0),
    L + "mlp.up_proj.weight": ((FFN, HIDDEN), "float8_e4m3fn", 0),
    L + "mlp.down_proj.weight": ((HIDDEN, FFN), "bfloat16", 1),
    L + "input_layernorm.weight": ((HIDDEN,), "float32", None),
    "model.norm.weight": ((HIDDEN,), "float32", None),
    "lm_head.weight": ((VOCAB, HIDDEN), "float32", 0),
}


def train_specs(tp=2, dp=2):
    """Megatron-like TP x DP trainer: rank = dp_index * tp + tp_rank; vocab padded to 64 per rank."""
    specs = {}
    for rank in range(tp * dp):
        tp_rank = rank % tp
        specs[rank] = []
        for name, (shape, dtype, dim) in PARAMS.items():
            if dim is None:
                box = full_box(shape)
            elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
                box = box_along(shape, 0, min(64 * tp_rank, VOCAB), min(64 * (tp_rank + 1), VOCAB))
            else:
                step = shape[dim] // tp
                box = box_along(shape, dim, tp_rank * step, (tp_rank + 1) * step)
            specs[rank].append(ShardSpec(name=name, global_shape=shape, dtype=dtype, box=box))
    return specs


def gen_specs(tp, dp=1, style="vllm"):
    params = {name: (shape, dtype) for name, (shape, dtype, _) in PARAMS.items()}
    return gen_target_specs(params, GenLayout(tp=tp, dp=dp), MODEL, style=style)


def full_tensors(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shape, generator=gen).to(getattr(torch, dtype)) for name, (shape, dtype, _) in PARAMS.items()
    }


def slices(box):
    return tuple(slice(a, b) for a, b in box)


def local_tensors(specs, full):
    """Each rank's pieces, as copies with transposed (non-contiguous) strides where 2-D."""
    out = {}
    for rank, rank_specs in specs.items():
        out[rank] = {}
        for spec in rank_specs:
            piece = full[spec.name][slices(spec.box)]
            out[rank][spec.name] = piece.T.contiguous().T if piece.dim() == 2 else piece.clone()
    return out


def same_bits(a, b):
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    )


def check_replay(plan, train, gen, full):
    got = replay(plan, local_tensors(train, full))
    for rank, specs in gen.items():
        assert sorted(got[rank]) == sorted(spec.name for spec in specs)
        for spec in specs:
            assert same_bits(got[rank][spec.name], full[spec.name][slices(spec.box)]), (rank, spec.name)


GEN_LAYOUTS = {
    "tp1_dp2": lambda: gen_specs(1, 2),
    "tp2": lambda: gen_specs(2),
    "tp4_kv_replicated": lambda: gen_specs(4),
    "tp4_dp2": lambda: gen_specs(4, 2),
    "full_dp3": lambda: gen_specs(1, 3, style="full"),
}


@pytest.mark.parametrize("bucket_bytes", [64 << 20, 100, 16])
@pytest.mark.parametrize("layout", sorted(GEN_LAYOUTS))
def test_replay_bit_exact(layout, bucket_bytes):
    train, gen, full = train_specs(), GEN_LAYOUTS[layout](), full_tensors()
    plan = RefitPlan.build(train, gen, bucket_bytes=bucket_bytes)
    check_replay(plan, train, gen, full)
    assert plan.bytes_sent == plan.bytes_minimal
    assert sum(plan.bytes_to(rank) for rank in gen) == plan.bytes_minimal
    assert sum(plan.bytes_from(rank) for rank in train) == plan.bytes_sent
    assert plan.unused_train_params == ()


def test_kv_replication_sends_each_head_to_two_ranks():
    plan = RefitPlan.build(train_specs(), gen_specs(4))
    k = [t for t in plan.transfers if t.name.endswith("k_proj.weight")]
    assert sorted((t.dst_rank, t.global_box[0]) for t in k) == [(0, (0, 2)), (1, (0, 2)), (2, (2, 4)), (3, (2, 4))]


def test_sender_load_spread_over_replicas():
    train = train_specs(tp=2, dp=2)
    plan = RefitPlan.build(train, gen_specs(1, 2))
    sent = [plan.bytes_from(rank) for rank in range(4)]
    assert all(sent)
    # Replicas (0, 2) and (1, 3) share the pieces of their TP rank within one piece's bytes.
    largest = max(t.nbytes for t in plan.transfers)
    assert abs(sent[0] - sent[2]) <= largest and abs(sent[1] - sent[3]) <= largest
    # The replicated norms go out of all four replicas, not always from rank 0.
    norm_senders = {t.src_rank for t in plan.transfers if t.name.endswith("norm.weight")}
    assert len(norm_senders) > 1


def test_buckets_respect_size_and_alignment():
    bucket_bytes = 40
    plan = RefitPlan.build(train_specs(), gen_specs(2), bucket_bytes=bucket_bytes)
    assert all(bucket.nbytes <= bucket_bytes for bucket in plan.buckets)
    for bucket in plan.buckets:
        assert all(item.offset % ALIGN == 0 for item in bucket.items)
        assert bucket.nbytes == bucket.items[-1].offset + bucket.items[-1].transfer.nbytes
    # The embedding transfer (64 x 8 float32 = 2 KiB) is split into row chunks of 32 bytes.
    embed = [
        item.transfer for b in plan.buckets for item in b.items if item.transfer.name == "model.embed_tokens.weight"
    ]
    assert len(embed) == VOCAB
    assert sum(t.nbytes for t in embed) == sum(
        t.nbytes for t in plan.transfers if t.name == "model.embed_tokens.weight"
    )
    # Bucket indices count up per (src, dst) pair, and buckets_from / buckets_to partition them.
    for src in range(4):
        for dst in range(2):
            pair = [b for b in plan.buckets if (b.src_rank, b.dst_rank) == (src, dst)]
            assert [b.index for b in pair] == list(range(len(pair)))
    assert sum(len(plan.buckets_from(r)) for r in range(4)) == len(plan.buckets)
    assert sum(len(plan.buckets_to(r)) for r in range(2)) == len(plan.buckets)
    assert all(b.src_rank == 3 for b in plan.buckets_from(3))
    assert all(b.dst_rank == 1 for b in plan.buckets_to(1))


@pytest.mark.parametrize("bucket_bytes, direct_bytes", [(1 << 20, None), (1 << 20, 1 << 20), (200, None), (200, 64),
                                                        (40, 24)])
def test_a_small_route_packs_as_the_general_packer_packs_it(bucket_bytes, direct_bytes):
    """bucketize packs a route that fits one bucket with none of its transfers going direct
    without the general packer (_one_bucket): the same buckets as _pack gives, every route."""
    from megatron_refit.plan.buckets import BY_NAME_BOX, Bucket, _pack, bucketize

    plan = RefitPlan.build(train_specs(), gen_specs(2), bucket_bytes=bucket_bytes)
    by_route: dict = {}
    for t in plan.transfers:
        by_route.setdefault((t.src_rank, t.dst_rank), []).append(t)
    want = []
    for (src, dst), route in sorted(by_route.items()):
        packed = _pack([[t] for t in sorted(route, key=BY_NAME_BOX)], bucket_bytes, direct_bytes)
        want += [Bucket(src, dst, i, tuple(items), items[-1].offset + items[-1].transfer.nbytes,
                        sum(item.transfer.nbytes for item in items)) for i, items in enumerate(packed)]
    assert bucketize(list(plan.transfers), bucket_bytes, direct_bytes) == want


def test_row_larger_than_bucket_gets_own_bucket():
    # A row of down_proj is 12 bf16 = 24 bytes > 16: every row alone in a bucket.
    plan = RefitPlan.build(train_specs(), gen_specs(1), bucket_bytes=16)
    down = [b for b in plan.buckets if b.items[0].transfer.name.endswith("down_proj.weight")]
    assert down and all(len(b.items) == 1 and b.nbytes == 12 for b in down)
    check_replay(plan, train_specs(), gen_specs(1), full_tensors())


def test_fingerprint():
    first = RefitPlan.build(train_specs(), gen_specs(2))
    shuffled = {rank: random.Random(rank).sample(specs, len(specs)) for rank, specs in train_specs().items()}
    assert RefitPlan.build(shuffled, gen_specs(2)).fingerprint() == first.fingerprint()
    assert RefitPlan.build(train_specs(), gen_specs(4)).fingerprint() != first.fingerprint()
    assert RefitPlan.build(train_specs(), gen_specs(2), bucket_bytes=64).fingerprint() != first.fingerprint()
    assert RefitPlan.build(train_specs(), gen_specs(2), gen_rank_ids=[0, 1]).fingerprint() != first.fingerprint()


def test_global_rank_ids():
    plan = RefitPlan.build(train_specs(), gen_specs(2))
    assert plan.train_global == (0, 1, 2, 3) and plan.gen_global == (4, 5)
    colocated = RefitPlan.build(train_specs(), gen_specs(2), train_rank_ids=[3, 2, 1, 0], gen_rank_ids=[0, 2])
    for bucket in colocated.buckets:
        assert colocated.global_src(bucket) == 3 - bucket.src_rank
        assert colocated.global_dst(bucket) == 2 * bucket.dst_rank


def test_unused_train_params_and_gen_pieces():
    gen = {rank: [s for s in specs if s.name != "lm_head.weight"] for rank, specs in gen_specs(2).items()}
    plan = RefitPlan.build(train_specs(), gen)
    assert plan.unused_train_params == ("lm_head.weight",)
    assert all(t.name != "lm_head.weight" for t in plan.transfers)
    assert plan.gen_pieces(1) == gen[1]
    summary = plan.summary()
    assert summary["num_unused_train_params"] == 1 and summary["bytes_sent"] == summary["bytes_minimal"]


def test_pack_into_given_buffer_and_unpack():
    train, gen, full = train_specs(), gen_specs(2), full_tensors()
    plan = RefitPlan.build(train, gen)
    local = local_tensors(train, full)
    bucket = plan.buckets_to(1)[0]
    out = torch.full((bucket.nbytes + 32,), 7, dtype=torch.uint8)
    buf = pack_bucket(bucket, local[bucket.src_rank].__getitem__, out=out)
    assert buf.data_ptr() == out.data_ptr() and buf.numel() == bucket.nbytes
    dst = {spec.name: torch.zeros(spec.shape, dtype=getattr(torch, spec.dtype)) for spec in gen[1]}
    unpack_bucket(bucket, buf, dst.__getitem__)
    for item in bucket.items:
        t = item.transfer
        assert same_bits(dst[t.name][slices(t.dst_box)], full[t.name][slices(t.global_box)])
    with pytest.raises(ValueError, match="1-D uint8 tensor of at least"):
        pack_bucket(bucket, local[bucket.src_rank].__getitem__, out=torch.empty(bucket.nbytes - 1, dtype=torch.uint8))


def spec(name, shape, box, dtype="float32"):
    return ShardSpec(name=name, global_shape=shape, dtype=dtype, box=box)


W = "w.weight"


@pytest.mark.parametrize(
    "train, gen, match",
    [
        (
            {0: [spec(W, (4,), ((0, 4),))] * 2},
            {0: [spec(W, (4,), ((0, 4),))]},
            "w.weight: listed twice on train rank 0",
        ),
        ({0: [spec(W, (4,), ((0, 4),))]}, {0: [spec(W, (4,), ((0, 4),))] * 2}, "w.weight: listed twice on gen rank 0"),
        (
            {0: [spec(W, (4,), ((0, 4),))]},
            {0: [spec("x", (4,), ((0, 4),))]},
            "HF name x is not produced by the trainer",
        ),
        (
            {0: [spec(W, (4,), ((0, 4),))]},
            {0: [spec(W, (5,), ((0, 4),))]},
            r"w.weight: global shape \(5,\) on gen ranks, \(4,\) on train",
        ),
        (
            {0: [spec(W, (4,), ((0, 4),))]},
            {0: [spec(W, (4,), ((0, 4),), "bfloat16")]},
            "w.weight: dtype bfloat16 on gen ranks, float32 on train",
        ),
        (
            {0: [spec(W, (4,), ((0, 3),))], 1: [spec(W, (4,), ((2, 4),))]},
            {0: [spec(W, (4,), ((0, 4),))]},
            "w.weight: train pieces cover 5 elements",
        ),
        (
            # A gap at row 3 and an overlap at row 1: the element count alone matches.
            {0: [spec(W, (4, 2), ((0, 2), (0, 2)))], 1: [spec(W, (4, 2), ((1, 3), (0, 2)))]},
            {0: [spec(W, (4, 2), ((0, 4), (0, 2)))]},
            r"w.weight: train pieces .* overlap",
        ),
        ({0: [spec(W, (4,), ((0, 3),))]}, {0: [spec(W, (4,), ((0, 4),))]}, "w.weight: train pieces cover 3 elements"),
        (
            {0: [spec(W, (4,), ((0, 4),))], 1: [spec(W, (4,), ((0, 4),), "float16")]},
            {0: [spec(W, (4,), ((0, 4),))]},
            "w.weight: train pieces disagree.*float16 on train rank 1",
        ),
        ({0: [spec(W, (4,), ((0, 4),), "complex64")]}, {0: []}, "w.weight: unsupported dtype 'complex64'"),
        ({1: [spec(W, (4,), ((0, 4),))]}, {0: []}, r"train ranks must be 0..0, got \[1\]"),
    ],
)
@pytest.mark.reliability
def test_plan_errors(train, gen, match):
    with pytest.raises(PlanError, match=match):
        RefitPlan.build(train, gen)


def test_plan_argument_errors():
    train, gen = {0: [spec(W, (4,), ((0, 4),))]}, {0: [spec(W, (4,), ((0, 4),))]}
    with pytest.raises(PlanError, match="bucket_bytes must be a positive int, got 0"):
        RefitPlan.build(train, gen, bucket_bytes=0)
    with pytest.raises(PlanError, match=r"gen_rank_ids \[3, 4\] must be 1 distinct ranks"):
        RefitPlan.build(train, gen, gen_rank_ids=[3, 4])
    with pytest.raises(PlanError, match=r"train_rank_ids \[0, 0\] must be 2 distinct ranks"):
        RefitPlan.build({0: train[0], 1: train[0]}, gen, train_rank_ids=[0, 0])


def test_pack_refuses_a_piece_whose_dtype_is_not_its_specs():
    train = {0: [spec(W, (4,), ((0, 4),))]}
    plan = RefitPlan.build(train, {0: [spec(W, (4,), ((0, 4),))]})
    with pytest.raises(ValueError, match=r"w.weight: the local piece is torch.bfloat16, its spec \(and the plan\) "
                                         r"says float32"):
        pack_bucket(plan.buckets[0], {W: torch.zeros(4, dtype=torch.bfloat16)}.__getitem__)


def test_repack_gives_the_bytes_that_were_packed_over_a_dirty_buffer():
    """The engine's read-back (``stale_in``) repacks its live tensors into a reused scratch buffer
    and compares position sums with what landed: the alignment padding between items and after the
    last must come back as the zeros ``pack_bucket`` sent, whatever the buffer held before."""
    train = {0: [spec("a", (3,), ((0, 3),), "bfloat16"), spec("b", (5,), ((0, 5),)),
                 spec("c", (1,), ((0, 1),), "bfloat16")]}
    plan = RefitPlan.build(train, {0: list(train[0])}, bucket_bytes=1 << 10)
    (bucket,) = plan.buckets
    assert bucket.nbytes > sum(item.transfer.nbytes for item in bucket.items)  # there is padding
    tensors = {"a": torch.tensor([1.5, -2.0, 3.0], dtype=torch.bfloat16), "b": torch.arange(5, dtype=torch.float32),
               "c": torch.tensor([7.0], dtype=torch.bfloat16)}
    packed = pack_bucket(bucket, tensors.__getitem__)
    dirty = torch.full((bucket.nbytes + 8,), 0xAB, dtype=torch.uint8)
    assert torch.equal(repack_bucket(bucket, tensors.__getitem__, dirty), packed)


def test_local_plan_refuses_other_ranks_buckets():
    full = RefitPlan.build(train_specs(), gen_specs(2))
    local = RefitPlan.build(train_specs(), gen_specs(2), local=("gen", 1))
    assert local.buckets_to(1) == full.buckets_to(1) and local.bytes_to(1) == full.bytes_to(1)
    with pytest.raises(ValueError, match=r"this plan holds no buckets of gen rank 0 \(a local plan of gen rank 1\)"):
        local.buckets_to(0)
    with pytest.raises(ValueError, match="this plan holds no buckets of train rank 0"):
        local.buckets_from(0)
    for bad in (("gen", 2), ("engine", 0), ("train", "0")):
        with pytest.raises(PlanError, match="local must be"):
            RefitPlan.build(train_specs(), gen_specs(2), local=bad)


def test_disagreeing_ranks_are_named_the_same_everywhere():
    from megatron_refit.plan.agreement import disagreeing

    plan = RefitPlan.build(train_specs(), gen_specs(2))  # 4 train ranks (0-3), 2 gen ranks (4, 5)
    whole = plan.fingerprints()
    prints = [{k: v for k, v in whole.items() if k == "plan" or rank in (plan.train_global[k[0]],
                                                                         plan.gen_global[k[1]])}
              for rank in range(6)]
    assert disagreeing(plan, prints) == []
    pair = min(k for k in prints[5] if k != "plan")
    odd = [dict(p) for p in prints]
    odd[5][pair] = "x"  # one end sees the pair differently: both ends are named
    assert disagreeing(plan, odd) == sorted({plan.train_global[pair[0]], 5})
    odd = [dict(p) for p in prints]
    odd[2]["plan"] = "x"
    assert disagreeing(plan, odd) == [2]
    odd = [dict(p) for p in prints]
    odd[1][(9, 0)] = "x"  # a pair of ranks the plan does not have
    assert disagreeing(plan, odd) == [1]


def test_agreement_summaries_catch_what_the_full_fingerprints_catch():
    """prepare() gathers 16 numbers a rank (agreement) and gathers the full fingerprints only
    where in_agreement is False: every disagreement disagreeing() names must turn it False."""
    from megatron_refit.plan.agreement import agreement, disagreeing, in_agreement

    plan = RefitPlan.build(train_specs(), gen_specs(2))
    whole = plan.fingerprints()
    locals_ = [RefitPlan.build(train_specs(), gen_specs(2), local=("train", r)) for r in range(4)] + \
        [RefitPlan.build(train_specs(), gen_specs(2), local=("gen", r)) for r in range(2)]
    prints = [p.fingerprints() for p in locals_]
    assert all(p == {k: whole[k] for k in p} for p in prints)  # each rank's own routes, as the whole plan's
    assert in_agreement(plan, [agreement(p) for p in prints]) and disagreeing(plan, prints) == []
    route = min(k for k in prints[5] if k != "plan")
    cases = {"one end's route differs": (5, route, "x"), "a route one end lacks": (5, route, None),
             "a route the other end lacks": (plan.train_global[route[0]], (route[0], 0 if route[1] else 1), "y"),
             "the plan differs": (2, "plan", "x")}
    for why, (rank, key, value) in cases.items():
        odd = [dict(p) for p in prints]
        if value is None:
            del odd[rank][key]
        else:
            odd[rank][key] = value
        assert not in_agreement(plan, [agreement(p) for p in odd]), why
        assert disagreeing(plan, odd), why
    summaries = [agreement(p) for p in prints]
    assert all(len(s) == 16 and all(isinstance(v, int) and 0 <= v < 1 << 32 for v in s) for s in summaries)
    rows = [list(s) + [0] * 4 for s in summaries]  # as the control header's rows come back: padded
    assert in_agreement(plan, rows)
    for bad in (None, (1,), summaries[3][:8] + (1 << 32,) * 8, summaries[3][:8] + ("x",) * 8, summaries[3][:12]):
        assert not in_agreement(plan, summaries[:3] + [bad] + summaries[4:]), bad
    assert not in_agreement(plan, summaries[:-1])  # a rank missing
