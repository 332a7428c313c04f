"""Assignment, the one sender assignment: planned from the dry run's compact engine targets
(``gen_targets``) it equals what ``prepare()`` plans from every gen rank's ShardSpecs
(``gen_target_classes`` → ``SenderPlan``, the per-piece reference, and ``RefitPlan.build``),
field for field, on reduced shipped layouts (DeepSeek-V3, Qwen3-MoE; bf16 and FP8; engine
TP and expert parallel), with prepare()'s packed pieces and one rank's own transfers; and it
refuses what the plan refuses, with the same message. Its properties on random tilings
(exact coverage, balanced senders) are tests/unit/test_plan_properties.py's."""

from __future__ import annotations

import glob
import math
import os
import re

import pytest
from hypothesis import given, settings

from conversion.derive import derive_all_ranks, load_specs
from megatron_refit.tools.dryrun import _quantized, load_config, num_experts
from megatron_refit.plan.assignment import Assignment
from megatron_refit.plan.fp8_layout import fp8_param_table
from megatron_refit.plan.gen_layout import GenLayout, ModelShape, gen_target_classes, gen_targets
from megatron_refit.plan.refit_plan import RefitPlan
from megatron_refit.testing.reference_senders import SenderPlan, gen_classes, targets_of
from megatron_refit.errors import PlanError
from megatron_refit.plan.checks import ITEMSIZE, index_specs
from megatron_refit.plan.pieces import gen_targets_of, pack, pack_targets
from megatron_refit.plan.spec import ShardSpec, intersect
from megatron_refit.testing.plan_strategies import SETTINGS, problems

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _assert_same(assignment: Assignment, senders: SenderPlan) -> None:
    assert assignment.class_ranks == tuple(ranks for ranks, _ in senders.classes)
    for c, (_, items) in enumerate(senders.classes):
        assert assignment.items(c) == [(spec.name, spec.dtype, spec.box, pieces) for spec, pieces in items]
    assert assignment.train_bytes == senders.train_bytes
    assert assignment.unused_train_params == senders.unused_train_params
    assert assignment.gen_bytes() == senders.gen_bytes()
    assert assignment.num_transfers == senders.num_transfers
    assert assignment.route_bytes() == senders.route_bytes()


def _reduced(config: str, layers: set[int]):
    """Every train rank's specs of a shipped config (from its shipped cache), only the
    decoder layers ``layers`` and the non-layer parameters kept; and its ModelShape."""
    refit, preset, layout = load_config(os.path.join(ROOT, "configs", config))
    (path,) = glob.glob(os.path.join(ROOT, "configs", "cache", f"{refit.model}-{layout.describe()}-bfloat16.json.gz"))
    train = derive_all_ranks(layout, load_specs(path), num_experts(preset))
    kept = {}
    for rank, specs in train.items():
        if id(specs) not in kept:
            kept[id(specs)] = [s for s in specs if (m := _LAYER.match(s.name)) is None or int(m.group(1)) in layers]
        train[rank] = kept[id(specs)]
    model = ModelShape(num_attention_heads=preset["num_attention_heads"],
                       num_kv_heads=preset.get("num_key_value_heads") or preset["num_attention_heads"],
                       vocab_size=preset["vocab_size"], num_experts=num_experts(preset))
    return train, model


REDUCED = [  # (config, layers kept, gen layout, trainer FP8)
    # stage 0: dense layers 0-2; stage 1: MoE layers 3-6; last stage: 59-60. 256 experts.
    ("deepseek-v3.yaml", {0, 3, 60}, GenLayout(tp=4, dp=2), False),
    ("deepseek-v3.yaml", {3}, GenLayout(tp=32, dp=1), False),
    ("deepseek-v3.yaml", {0, 4}, GenLayout(tp=4, dp=3, expert_parallel=True), False),
    ("deepseek-v3.yaml", {0, 3}, GenLayout(tp=4, dp=2), True),  # weights + scale tiles
    # train TP4 (several train boxes per dense parameter, each held by 4 DP replicas)
    ("qwen3-235b-a22b.yaml", {0, 11, 93}, GenLayout(tp=8, dp=2), False),
    ("qwen3-235b-a22b.yaml", {12}, GenLayout(tp=2, dp=6), True),  # 6 replicas, 4 holders
    ("qwen3-30b-a3b.yaml", {0, 47}, GenLayout(tp=8, dp=2), False),
    ("qwen3-30b-a3b.yaml", {5}, GenLayout(tp=1, dp=3), False),
]


@pytest.mark.parametrize("config, layers, gen, fp8", REDUCED,
                         ids=[f"{c[:-5]}-L{min(layers)}-TP{g.tp}xDP{g.dp}{'-EP' * g.expert_parallel}{'-fp8' * q}"
                              for c, layers, g, q in REDUCED])
def test_assignment_equals_refit_plan_on_reduced_layouts(config, layers, gen, fp8):
    train, model = _reduced(config, layers)
    params = {s.name: (s.global_shape, s.dtype) for specs in train.values() for s in specs}
    if fp8:
        train, params = _quantized(train), fp8_param_table(params)
    targets = gen_targets(params, gen, model)
    assignment = Assignment.build(train, targets)
    assert len(assignment.groups) < len(params) // 10  # the experts form a few groups
    classes = gen_target_classes(params, gen, model)
    assert targets.ranks == tuple(ranks for ranks, _ in classes)
    _assert_same(assignment, SenderPlan.build(train, classes))

    gen_specs = {rank: specs for ranks, specs in classes for rank in ranks}
    plan = RefitPlan.build(train, gen_specs, bucket_bytes=1 << 30)
    transfers = assignment.transfers()
    assert transfers == list(plan.transfers)  # what SenderPlan.transfers() gives RefitPlan.build
    assert assignment.gen_bytes() == {rank: plan.bytes_to(rank) for rank in gen_specs}
    assert list(assignment.train_bytes) == [plan.bytes_from(rank) for rank in train]
    assert sum(assignment.gen_bytes().values()) == plan.bytes_sent == plan.bytes_minimal
    assert assignment.num_transfers == len(plan.transfers)
    assert assignment.unused_train_params == plan.unused_train_params
    assert {(t.src_rank, t.dst_rank, t.name, t.global_box, t.src_box, t.dst_box) for t in transfers} == {
        (t.src_rank, t.dst_rank, t.name, t.global_box, t.src_box, t.dst_box) for t in plan.transfers}

    # prepare()'s compact form: the receivers' packed pieces, from the targets without a
    # ShardSpec per piece, and the targets planned back from them
    parts = pack_targets(targets)
    assert parts == {rank: pack(sorted(specs, key=lambda s: s.name)) for rank, specs in gen_specs.items()}
    assert gen_targets_of(parts) == targets_of(classes)
    # one rank's transfers and counts, without expanding the others
    sent, received = assignment.transfer_counts()
    assert sent == [sum(t.src_rank == r for t in transfers) for r in train]
    assert received == [sum(t.dst_rank == r for t in transfers) for r in gen_specs]
    for r in {0, len(train) // 2, max(train, key=sent.__getitem__)}:
        assert assignment.transfers(src=r) == [t for t in transfers if t.src_rank == r]
    for r in {0, len(gen_specs) - 1}:
        assert assignment.transfers(dst=r) == [t for t in transfers if t.dst_rank == r]


def _turn_loads(train, gen) -> list[int]:
    """Bytes per train rank by the rule the docs state, written out plainly, turn by turn:
    the boxes each set of holders H holds are numbered, names in order, then train boxes in
    order; the gen ranks that need a piece of box number n, in order of class (by first rank)
    and rank, take its turns t = 0, 1, ..., and turn t is H[(n + t) % len(H)]."""
    classes = sorted(gen_classes(gen), key=lambda c: c[0][0])
    index, meta = index_specs("train", train)
    load = [0] * len(train)
    numbered = {}
    for name in sorted({s.name for _, specs in classes for s in specs}):
        for train_box in sorted(index[name]):
            holders = tuple(sorted(index[name][train_box]))
            n = numbered.get(holders, 0) if len(holders) > 1 else 0
            numbered[holders] = n + 1
            t = 0
            for ranks, specs in classes:
                (spec,) = [s for s in specs if s.name == name] or [None]
                if spec is None:
                    continue
                box = intersect(train_box, spec.box) if spec.box else train_box
                if box is None:
                    continue
                nbytes = math.prod(hi - lo for lo, hi in box) * ITEMSIZE[meta[name].dtype]
                for _ in ranks:
                    load[holders[(n + t) % len(holders)]] += nbytes
                    t += 1
    return load


@settings(max_examples=200, **SETTINGS)
@given(problems())
def test_senders_take_turns_on_random_tilings(problem):
    train, gen, _, _ = problem
    assignment = Assignment.build(train, targets_of(gen_classes(gen)))
    assert list(assignment.train_bytes) == _turn_loads(train, gen)
    assert sum(assignment.train_bytes) == sum(assignment.gen_bytes().values())
    # the senders each transfer names agree with the loads, transfer by transfer
    transfers = assignment.transfers()
    assert [sum(t.nbytes for t in transfers if t.src_rank == r) for r in range(len(train))] == list(
        assignment.train_bytes)


def _spec(name, shape, box, dtype="float32"):
    return ShardSpec(name=name, global_shape=shape, dtype=dtype, box=box)


@pytest.mark.parametrize("train, gen", [
    ({0: [_spec("a", (4,), ((0, 4),))]}, {0: [_spec("b", (4,), ((0, 4),))]}),  # not produced by the trainer
    ({0: [_spec("a", (4,), ((0, 4),))]}, {0: [_spec("a", (5,), ((0, 4),))]}),  # global shape
    ({0: [_spec("a", (4,), ((0, 4),))]}, {0: [_spec("a", (4,), ((0, 4),), "bfloat16")]}),  # dtype
    ({0: [_spec("a", (4,), ((0, 2),))], 1: [_spec("a", (4,), ((1, 4),))]}, {0: [_spec("a", (4,), ((0, 4),))]}),
    ({0: [_spec("a", (4,), ((0, 2),))], 1: [_spec("a", (4,), ((3, 4),))]}, {0: [_spec("a", (4,), ((0, 4),))]}),
    ({0: [_spec("a", (4,), ((0, 4),), "complex64")]}, {0: [_spec("a", (4,), ((0, 4),), "complex64")]}),
])
def test_assignment_refuses_what_refit_plan_refuses(train, gen):
    with pytest.raises(PlanError) as expected:
        RefitPlan.build(train, gen)
    with pytest.raises(PlanError, match=f"^{re.escape(str(expected.value))}$"):
        Assignment.build(train, targets_of(gen_classes(gen)))
