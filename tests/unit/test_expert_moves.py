"""An EPLB move re-planned (megatron_refit.plan.expert_moves, RefitPlan.replanned): after a wide
expert-parallel deployment's experts move, every rank's re-planned local plan equals a full
build of the new layout (transfers, buckets, every total, fingerprints), move after move; with
experts held by one train rank or two (expert data parallelism), redundant experts (two on one
rank included), the engine's gate/up adjacency, and DeepSeek-V3's shipped layout in FP8. Any
other change is left to a full build (None), which names what is wrong."""

from __future__ import annotations

import random

import pytest

from megatron_refit.plan.expert_placement import ExpertPlacement, slots_of
from megatron_refit.plan.folded import fold
from megatron_refit.plan.fp8_layout import fp8_param_table
from megatron_refit.plan.gen_layout import GenLayout, gen_target_specs
from megatron_refit.plan.pieces import pack
from megatron_refit.plan.refit_plan import build_local_plan
from megatron_refit.plan.spec import box_along
from megatron_refit.tools.dryrun import _quantized
from tests.unit.test_wide_ep_layout import (D, MOE_LAYERS, TP, deepseek_v3_deployment, deepseek_v3_reduced,
                                            megatron_pieces, model, params, permuted_maps)

BUCKET = 4096


def _gen_parts(table, layout, shape, *, adjacent=False) -> list[tuple]:
    """Each engine rank's pieces as its prepare() gathers them (packed, its experts folded); with
    ``adjacent``, its memory as vLLM's fused MoE weights lay it out, slot after slot: gate and up
    of a slot, then the next slot's gate (``w13``), down after down (``w2``)."""
    out = []
    for rank, specs in sorted(gen_target_specs(table, layout, shape).items()):
        names = {s.name for s in specs}
        pairs = []
        for m, layer in enumerate(MOE_LAYERS if adjacent else ()):
            stem = f"model.layers.{layer}.mlp.experts."
            row = list(dict.fromkeys(e for _, e in slots_of(layout.placement, rank, m)))  # a name once
            for k, e in enumerate(row):
                pairs.append((f"{stem}{e}.gate_proj.weight", f"{stem}{e}.up_proj.weight"))
                if k + 1 < len(row):
                    pairs.append((f"{stem}{e}.up_proj.weight", f"{stem}{row[k + 1]}.gate_proj.weight"))
                    pairs.append((f"{stem}{e}.down_proj.weight", f"{stem}{row[k + 1]}.down_proj.weight"))
        assert all(a in names and b in names for a, b in pairs)
        out.append(fold(*pack(specs, pairs)))
    return out


def _check_moves(train_parts, gen_layouts, table, shape, *, locals_, direct=None, adjacent=False, optional=(),
                 bucket=BUCKET):
    """For each local rank: the plan of the first layout, re-planned into each next one in turn,
    equals a full build of that layout; returns the direct runs of several pieces they hold."""
    parts = [_gen_parts(table, layout, shape, adjacent=adjacent) for layout in gen_layouts]
    num_train = len(train_parts)
    kw = dict(bucket_bytes=bucket, direct_bytes=direct, optional=frozenset(optional))
    runs = 0
    for local in locals_:
        plan = build_local_plan(train_parts + parts[0], num_train, local=local, **kw)
        assert plan.basis is not None, local
        for gen in parts[1:]:
            moved = plan.replanned(dict(enumerate(gen)))
            full = build_local_plan(train_parts + gen, num_train, local=local, **kw)
            assert moved is not None, local
            assert moved == full, local
            assert any(".experts." in t.name for t in moved.transfers) or local == ("train", 3), local
            assert moved.fingerprints() == full.fingerprints(), local
            side = "buckets_from" if local[0] == "train" else "buckets_to"
            assert getattr(moved, side)(local[1]) == getattr(full, side)(local[1]), local
            runs += direct is not None and sum(len(b.items) > 1 and all(i.transfer.nbytes >= direct for i in b.items)
                                               for b in moved.buckets)
            plan = moved
    return runs


def _deployment(num_experts, redundant, seed, *, twice_on_rank0=False):
    maps = permuted_maps(num_experts, redundant, seed, twice_on_rank0=twice_on_rank0)
    placement = ExpertPlacement(num_logical_experts=num_experts, ep_size=TP * D, num_redundant=redundant,
                                physical_to_logical=maps)
    return GenLayout(tp=TP, attention_dp=D, expert_parallel=True, placement=placement)


@pytest.mark.parametrize("num_experts, redundant, train_dp, adjacent", [
    (8, 2, 1, False),   # each expert on one train rank
    (8, 2, 2, False),   # each expert on two train ranks (expert data parallelism): turns
    (64, 4, 2, True),   # 64 experts, the engine's memory chained (its holders' turns part gate from up)
    (64, 4, 1, True),   # the same from one holder each: gate and up in one direct run
])
def test_a_move_replans_what_a_full_build_plans(num_experts, redundant, train_dp, adjacent):
    table = params(num_experts, dtype="bfloat16")
    train = megatron_pieces(table, num_experts, dp=train_dp)
    # Megatron's fc1 holds an expert's gate and up back to back: direct runs where the engine does too
    train_parts = [pack(train[r], [(s.name, s.name.replace("gate_proj", "up_proj")) for s in train[r]
                                   if adjacent and ".experts." in s.name and "gate_proj" in s.name])
                   for r in sorted(train)]
    layouts = [_deployment(num_experts, redundant, seed, twice_on_rank0=seed == 2) for seed in (1, 2, 3)]
    ranks = [("train", r) for r in range(len(train))] + [("gen", r) for r in range(TP * D)]
    runs = _check_moves(train_parts, layouts, table, model(num_experts), locals_=ranks, adjacent=adjacent,
                        direct=64 if adjacent else None)
    assert runs or not (adjacent and train_dp == 1)  # the engine's pairs after a move (expert_moves._Next) asked


def test_deepseek_v3_fp8_moves_replan_what_a_full_build_plans():
    """DeepSeek-V3's shipped train layout (TP1 PP16 EP16), dense layer 0 and MoE layers 3-4, FP8
    weights and scale tiles, into one D4 x T2 deployment with 256 + 16 experts under EPLB."""
    train, shape = deepseek_v3_reduced()
    table = fp8_param_table({s.name: (s.global_shape, s.dtype) for specs in train.values() for s in specs})
    train = _quantized(train, set())  # FP8 weights and their scale tiles, as the dry run quantizes
    rng = random.Random(5)
    layouts = [deepseek_v3_deployment(rng) for _ in range(3)]
    train_parts = [pack(train[r]) for r in sorted(train)]
    _check_moves(train_parts, layouts, table, shape, bucket=64 << 20,
                 locals_=[("gen", 0), ("gen", 7), ("train", 3), ("train", 16), ("train", 27)])


def test_other_changes_are_left_to_a_full_build():
    table = params(8, dtype="bfloat16")
    train = megatron_pieces(table, 8)
    train_parts = [pack(train[r]) for r in sorted(train)]
    first, second = (_gen_parts(table, _deployment(8, 2, seed), model(8)) for seed in (1, 2))
    plan = build_local_plan(train_parts + first, len(train_parts), bucket_bytes=BUCKET, direct_bytes=None,
                            local=("gen", 1))
    # a dense piece on another box
    specs = gen_target_specs(table, _deployment(8, 2, 2), model(8))[1]
    q = "model.layers.0.self_attn.q_proj.weight"
    shape = table[q][0]
    changed = [s if s.name != q else type(s)(s.name, s.global_shape, s.dtype, box_along(shape, 0, 0, shape[0]))
               for s in specs]
    assert plan.replanned(dict(enumerate(second[:1] + [fold(*pack(changed))] + second[2:]))) is None
    # an expert no rank holds any more: the full build names it
    gone = ".layers.1.mlp.experts.0."
    specs_now = gen_target_specs(table, _deployment(8, 2, 2), model(8))
    assert any(gone in s.name for specs in specs_now.values() for s in specs)
    without = [fold(*pack([s for s in specs if gone not in s.name])) for _, specs in sorted(specs_now.items())]
    assert plan.replanned(dict(enumerate(without))) is None
    with pytest.raises(ValueError, match=r"no generation rank holds .*experts\.0\."):
        build_local_plan(train_parts + without, len(train_parts), bucket_bytes=BUCKET, direct_bytes=None,
                         local=("gen", 1))
    # the same move again and the first layout back: re-planned; a plan over engine TP ranks
    # (experts sharded, held by every rank) keeps nothing to move
    assert plan.replanned(dict(enumerate(first))) == plan
    tp_layout = GenLayout(tp=2, dp=1)
    tp_parts = [pack(s) for _, s in sorted(gen_target_specs(table, tp_layout, model(8)).items())]
    assert build_local_plan(train_parts + tp_parts, len(train_parts), bucket_bytes=BUCKET, direct_bytes=None,
                            local=("gen", 0)).basis is None
    # parts gathered plain (not folded): nothing to move by numbers, every change built in full
    plain = [pack(s) for _, s in sorted(gen_target_specs(table, _deployment(8, 2, 1), model(8)).items())]
    assert build_local_plan(train_parts + plain, len(train_parts), bucket_bytes=BUCKET, direct_bytes=None,
                            local=("gen", 1)).basis is None
    assert plan.replanned(dict(enumerate(plain))) is None
    # a rank's layer-1 experts left unfolded (one of its pieces there a slice, not whole) while
    # another rank holds one of them folded: that expert would not move on the first, so built in full
    specs = gen_target_specs(table, _deployment(8, 2, 1), model(8))
    held = {r: {n.split(".")[5] for n in (x.name for x in specs[r]) if ".layers.1.mlp.experts." in n} for r in specs}
    rank, shared = next((r, e) for r in held for e in held[r] if any(e in held[o] for o in held if o != r))
    cut = next(x for x in specs[rank] if ".layers.1.mlp.experts." in x.name and x.name.split(".")[5] != shared)
    sliced = [x if x is not cut else type(x)(x.name, x.global_shape, x.dtype, box_along(x.global_shape, 0, 0, 1))
              for x in specs[rank]]
    mixed = [fold(*pack(sliced if r == rank else x)) for r, x in sorted(specs.items())]
    assert f"model.layers.1.mlp.experts.{shared}.up_proj.weight" in mixed[rank][0][0]  # plain there, folded elsewhere
    assert build_local_plan(train_parts + mixed, len(train_parts), bucket_bytes=BUCKET, direct_bytes=None,
                            local=("gen", 1)).basis is None
