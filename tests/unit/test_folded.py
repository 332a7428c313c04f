"""An engine rank's whole experts folded (megatron_refit.plan.folded): through the wire and back
to exactly pack()'s parts, whatever the pieces (Hypothesis: experts whole or sliced, suffixes
missing on some experts, adjacent pairs within an expert, across experts and to other pieces,
names like "experts.01."); the names part unchanged when only the experts held change; the
plan built from folded parts equal to the plan from plain ones; a peer's malformed folded
parts refused naming the rank."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_refit import wire
from megatron_refit.errors import PlanError
from megatron_refit.plan.folded import fold, is_folded, unfold
from megatron_refit.plan.gen_layout import gen_target_specs
from megatron_refit.plan.pieces import pack
from megatron_refit.plan.refit_plan import build_local_plan
from megatron_refit.plan.spec import ShardSpec, box_along, full_box
from tests.unit.test_expert_moves import _deployment
from tests.unit.test_wide_ep_layout import megatron_pieces, model, params

SUFFIXES = ("down_proj.weight", "gate_proj.weight", "up_proj.weight", "gate_proj.weight_scale_inv")


def _roundtrip(obj):
    return wire.loads(wire.dumps(obj))


@st.composite
def _pieces(draw):
    """A rank's pieces: per MoE layer some experts (whole, or a row slice), each with some
    suffixes; dense pieces; adjacent pairs of any of them."""
    specs = [ShardSpec("model.embed_tokens.weight", (16, 4), "bfloat16", full_box((16, 4))),
             ShardSpec("model.layers.0.mlp.shared_experts.gate_proj.weight", (8, 4), "bfloat16", full_box((8, 4)))]
    for layer in range(draw(st.integers(1, 3))):
        suffixes = draw(st.lists(st.sampled_from(SUFFIXES), min_size=1, max_size=4, unique=True))
        sliced = draw(st.booleans())
        for e in draw(st.lists(st.integers(0, 40), min_size=1, max_size=6, unique=True)):
            mine = suffixes if draw(st.integers(0, 9)) else suffixes[:1]  # now and then an expert lacks some
            for suffix in mine:
                shape = (8, 4)
                box = box_along(shape, 0, 0, 4) if sliced else full_box(shape)
                number = {0: f"0{e}", 1: str(e + (1 << 32))}.get(draw(st.integers(0, 19)), str(e))
                specs.append(ShardSpec(f"model.layers.{layer}.mlp.experts.{number}.{suffix}", shape, "bfloat16", box))
    names = sorted({s.name for s in specs})
    pairs = []
    for _ in range(draw(st.integers(0, 6))):
        a = draw(st.sampled_from(names))
        if draw(st.booleans()) and "gate_proj.weight" in a and a.endswith("weight"):
            pairs += [(a, a.replace("gate_proj", "up_proj"))]  # within one expert (when it holds both)
        else:
            pairs.append((a, draw(st.sampled_from(names))))
    return specs, [(a, b) for a, b in pairs if b in names]


@settings(max_examples=200, deadline=None)
@given(_pieces())
def test_folded_parts_unfold_to_exactly_the_packed_parts(drawn):
    specs, pairs = drawn
    packed = pack(specs, pairs)
    folded = fold(*packed)
    assert unfold("gen", 0, *_roundtrip(folded)) == packed
    if is_folded(folded):  # what folds: each folded name is gone from the plain names
        assert len(folded[0][0]) < len(packed[0][0])


def test_a_move_changes_the_layout_part_only():
    """One deployment's rank 0 before and after its experts moved: the names part is the same
    object value (the gather moves it by digest), the layout part a few numbers per layer."""
    table = params(64, dtype="bfloat16")
    before, after = (fold(*pack(gen_target_specs(table, _deployment(64, 4, seed), model(64))[0])) for seed in (1, 2))
    assert is_folded(before) and before[0] == after[0] and before[1][:3] == after[1][:3]
    assert before[1][3] != after[1][3]
    assert len(wire.dumps(before[1])) < len(wire.dumps(pack(gen_target_specs(table, _deployment(64, 4, 1),
                                                                           model(64))[0])[0])) // 4


@pytest.mark.parametrize("adjacent", [False, True])
def test_a_plan_of_folded_parts_equals_the_plan_of_plain_parts(adjacent):
    table = params(8, dtype="bfloat16")
    train = megatron_pieces(table, 8)
    train_parts = [pack(train[r]) for r in sorted(train)]
    gen = gen_target_specs(table, _deployment(8, 2, 3), model(8))
    pairs = {r: [(s.name, s.name.replace("gate_proj", "up_proj")) for s in specs if adjacent and ".experts." in s.name
                 and "gate_proj" in s.name] for r, specs in gen.items()}
    plain = [pack(gen[r], pairs[r]) for r in sorted(gen)]
    folded = [_roundtrip(fold(*part)) for part in plain]
    assert all(map(is_folded, folded))
    for local in (("gen", 0), ("gen", 3), ("train", 1)):
        kw = dict(bucket_bytes=4096, direct_bytes=64 if adjacent else None, local=local)
        want = build_local_plan(train_parts + plain, len(train_parts), **kw)
        got = build_local_plan(train_parts + folded, len(train_parts), **kw)
        assert dataclasses.replace(got, gen_parts=want.gen_parts) == want  # the parts kept as gathered
        assert got.fingerprints() == want.fingerprints()
        if local[0] == "gen":
            assert got.gen_pieces(local[1]) == want.gen_pieces(local[1])


def _broken(how: str) -> tuple:
    table = params(8, dtype="bfloat16")
    specs = gen_target_specs(table, _deployment(8, 2, 3), model(8))[1]
    (names, pairs, stems), (kinds, raw, suffix_kinds, rows, outer) = fold(*pack(specs))
    if how == "rows":
        rows = rows[:-1]
    elif how == "stem":
        stems = (("model.layers.1.mlp.experts.", "w"),) + stems[1:]
    elif how == "kinds":
        suffix_kinds = suffix_kinds[:-4]
    elif how == "plain":
        raw = raw[:-1]
    elif how == "pairs":
        outer = outer + b"\x00"
    return (names, pairs, stems), (kinds, raw, suffix_kinds, rows, outer)


@pytest.mark.parametrize("how, match", [
    ("rows", r"gen rank 1: malformed folded experts \(expected one uint32 row per stem\)"),
    ("stem", r"gen rank 1: malformed expert stem \('model\.layers\.1\.mlp\.experts\.', 'w'\) \(expected \(prefix"),
    ("kinds", r"gen rank 1: \d+ expert suffix kinds for \d+ suffixes"),
    ("plain", r"gen rank 1: malformed folded pieces \(expected \(\(names, pairs, stems\)"),
    ("pairs", r"gen rank 1: malformed folded pieces \(expected the experts' pairs as int32 pairs\)"),
])
@pytest.mark.reliability
def test_malformed_folded_parts_from_a_peer_are_refused_naming_it(how, match):
    with pytest.raises(PlanError, match=match):
        unfold("gen", 1, *_broken(how))
