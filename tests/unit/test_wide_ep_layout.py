"""One replica as a wide expert-parallel deployment (GenLayout.attention_dp, .placement; #64): the
attention boxes of the D data-parallel ranks of a TP rank are the same, every physical slot's
logical expert is on its rank, once however many slots hold it, and each gen rank's bytes are the
minimal ones (its attention shard plus its slots' distinct experts); MoE-TP over D x T without
expert parallelism; FP8 scale tiles following their weights; the refusals. Then a RefitPlan from
Megatron-like train pieces (TP2 x EP2) into D2 x T2 with redundant experts, and from DeepSeek-V3's
shipped train layout, covering every gen rank's elements exactly once."""

from __future__ import annotations

import glob
import math
import os
import random

import pytest
import torch

from conversion.derive import derive_all_ranks, load_specs
from megatron_refit.endpoint.bytes import replay
from megatron_refit.plan.assignment import Assignment
from megatron_refit.plan.checks import ITEMSIZE
from megatron_refit.plan.deployment import holders_per_expert, layer_index, local_slots, moe_layers
from megatron_refit.plan.expert_placement import ExpertPlacement, ranks_holding, slots_of, vllm_placement
from megatron_refit.plan.fp8_layout import fp8_param_table, scale_box, scale_name
from megatron_refit.plan.gen_layout import GenLayout, ModelShape, gen_target_classes, gen_target_specs, gen_targets
from megatron_refit.plan.pieces import gen_targets_of, pack_targets
from megatron_refit.plan.refit_plan import RefitPlan
from megatron_refit.plan.spec import ShardSpec, box_along, box_numel, full_box
from megatron_refit.tools.dryrun import load_config, num_experts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

H, HD, HEADS, KV, FFN, MI, V = 16, 4, 4, 2, 24, 8, 100
TP, D = 2, 2
LAYERS = (0, 1, 2)
MOE_LAYERS = (1, 2)
"""Layer 0 is dense: HF layers 1 and 2 are MoE layers 0 and 1 of the placement's maps."""


def model(num_experts):
    return ModelShape(num_attention_heads=HEADS, num_kv_heads=KV, vocab_size=V, num_experts=num_experts)


def params(num_experts, *, hidden=H, ffn=FFN, mi=MI, hd=HD, dtype="float32"):
    p = {"model.embed_tokens.weight": (V, hidden), "lm_head.weight": (V, hidden), "model.norm.weight": (hidden,)}
    for layer in LAYERS:
        L = f"model.layers.{layer}."
        p |= {L + "input_layernorm.weight": (hidden,), L + "self_attn.q_proj.weight": (HEADS * hd, hidden),
              L + "self_attn.k_proj.weight": (KV * hd, hidden), L + "self_attn.v_proj.weight": (KV * hd, hidden),
              L + "self_attn.o_proj.weight": (hidden, HEADS * hd)}
        if layer not in MOE_LAYERS or not num_experts:
            p |= {L + "mlp.gate_proj.weight": (ffn, hidden), L + "mlp.up_proj.weight": (ffn, hidden),
                  L + "mlp.down_proj.weight": (hidden, ffn)}
            continue
        p |= {L + "mlp.gate.weight": (num_experts, hidden), L + "mlp.shared_experts.gate_proj.weight": (ffn, hidden),
              L + "mlp.shared_experts.up_proj.weight": (ffn, hidden),
              L + "mlp.shared_experts.down_proj.weight": (hidden, ffn)}
        for e in range(num_experts):
            p |= {L + f"mlp.experts.{e}.gate_proj.weight": (mi, hidden),
                  L + f"mlp.experts.{e}.up_proj.weight": (mi, hidden),
                  L + f"mlp.experts.{e}.down_proj.weight": (hidden, mi)}
    return {name: (shape, dtype) for name, shape in p.items()}


def permuted_maps(num_logical, num_redundant, seed, *, twice_on_rank0=False):
    """Per MoE layer: every expert once, the redundant slots on random experts, shuffled;
    ``twice_on_rank0``: the first two slots (rank 0's under ``linear``) hold one expert."""
    rng = random.Random(seed)
    rows = []
    for _ in MOE_LAYERS:
        row = list(range(num_logical))
        rng.shuffle(row)
        extra = [rng.randrange(num_logical) for _ in range(num_redundant)]
        if twice_on_rank0:
            extra[0] = row[0]
            row = [row[0], extra[0], *row[1:], *extra[1:]]
        else:
            row += extra
            rng.shuffle(row)
        rows.append(tuple(row))
    return tuple(rows)


def wide(num_experts, num_redundant=2, *, twice_on_rank0=False, dp=1, strategy="linear"):
    placement = ExpertPlacement(num_logical_experts=num_experts, ep_size=TP * D, num_redundant=num_redundant,
                                strategy=strategy, physical_to_logical=permuted_maps(
                                    num_experts, num_redundant, num_experts, twice_on_rank0=twice_on_rank0))
    return GenLayout(tp=TP, dp=dp, attention_dp=D, expert_parallel=True, placement=placement)


def by_rank(specs):
    """``{gen rank: {name: box}}``, refusing a name listed twice on a rank."""
    out = {}
    for rank, rank_specs in specs.items():
        out[rank] = {s.name: s.box for s in rank_specs}
        assert len(out[rank]) == len(rank_specs), rank
    return out


def nbytes(table, name, box):
    return box_numel(box) * ITEMSIZE[table[name][1]]


def expert_of(name):
    return int(name.split(".experts.")[1].split(".")[0])


CASES = [(8, 2, "linear"), (64, 2, "linear"), (64, 2, "round_robin"), (8, 4, "linear")]


@pytest.mark.parametrize("num_experts, num_redundant, strategy", CASES)
def test_attention_per_tp_rank_and_every_slot_held_once_at_minimal_bytes(num_experts, num_redundant, strategy):
    layout = wide(num_experts, num_redundant, twice_on_rank0=strategy == "linear", strategy=strategy)
    table = params(num_experts)
    got = by_rank(gen_target_specs(table, layout, model(num_experts)))
    assert sorted(got) == list(range(TP * D))
    dense = {name: value for name, value in table.items() if ".experts." not in name}
    attention = by_rank(gen_target_specs(dense, GenLayout(tp=TP), model(num_experts)))
    for rank, held in got.items():
        # the dense weights (attention, router, shared experts) are TP rank rank % TP's, as at TP2
        assert {n: b for n, b in held.items() if ".experts." not in n} == attention[rank % TP]
        needed = sum(nbytes(table, n, b) for n, b in attention[rank % TP].items())
        for moe_layer, layer in enumerate(MOE_LAYERS):
            slots = slots_of(layout.placement, rank, moe_layer)
            logical = {e for _, e in slots}
            prefix = f"model.layers.{layer}.mlp.experts."
            experts = {n: b for n, b in held.items() if n.startswith(prefix)}
            assert {expert_of(n) for n in experts} == logical  # every slot's expert, and no other
            assert all(b == full_box(table[n][0]) for n, b in experts.items())
            needed += sum(nbytes(table, n, full_box(table[n][0])) for n in table
                          if n.startswith(prefix) and expert_of(n) in logical)
        assert sum(nbytes(table, n, b) for n, b in held.items()) == needed, rank
    if strategy == "linear":  # rank 0 holds one expert in two slots of each layer: received once
        for moe_layer in range(len(MOE_LAYERS)):
            (twice,) = [e for e, local in local_slots(layout.placement, 0, moe_layer).items() if len(local) == 2]
            assert local_slots(layout.placement, 0, moe_layer)[twice] == (0, 1)
            assert len([s for s in gen_target_specs(table, layout, model(num_experts))[0]
                        if s.name == f"model.layers.{MOE_LAYERS[moe_layer]}.mlp.experts.{twice}.up_proj.weight"]) == 1


def test_replicas_number_their_ranks_after_the_deployment():
    layout = wide(8, dp=3)
    assert (layout.deployment_size, layout.world_size) == (4, 12)
    targets = gen_targets(params(8), layout, model(8))
    assert targets.ranks == ((0, 4, 8), (1, 5, 9), (2, 6, 10), (3, 7, 11))
    specs = gen_target_specs(params(8), layout, model(8))
    for rank in range(12):
        assert specs[rank] == specs[rank % 4]


def test_one_map_for_every_layer_and_the_initial_map_by_default():
    table = params(8)
    initial = GenLayout(tp=TP, attention_dp=D, expert_parallel=True)
    explicit = GenLayout(tp=TP, attention_dp=D, expert_parallel=True,
                         placement=ExpertPlacement(num_logical_experts=8, ep_size=4))
    assert gen_targets(table, initial, model(8)) == gen_targets(table, explicit, model(8))
    held = by_rank(gen_target_specs(table, initial, model(8)))
    for rank in range(4):  # linear: experts 2 * rank, 2 * rank + 1
        assert {expert_of(n) for n in held[rank] if ".experts." in n} == {2 * rank, 2 * rank + 1}
    # attention_dp 1 with a placement: the TP ranks' classes, whole experts where the map puts them
    at_tp = GenLayout(tp=4, expert_parallel=True)
    placed = GenLayout(tp=4, expert_parallel=True, placement=ExpertPlacement(num_logical_experts=8, ep_size=4))
    assert gen_targets(table, placed, model(8)) == gen_targets(table, at_tp, model(8))


def test_moe_tp_over_the_deployment_without_expert_parallelism():
    table = params(8)
    got = by_rank(gen_target_specs(table, GenLayout(tp=TP, attention_dp=D), model(8)))
    tp2 = by_rank(gen_target_specs(table, GenLayout(tp=TP), model(8)))
    flat = by_rank(gen_target_specs(table, GenLayout(tp=TP * D), model(8)))
    for rank in range(TP * D):
        assert got[rank]["model.layers.1.mlp.experts.3.gate_proj.weight"] == ((rank * 2, rank * 2 + 2), (0, H))
        assert got[rank]["model.layers.2.mlp.experts.7.down_proj.weight"] == ((0, H), (rank * 2, rank * 2 + 2))
        for name, box in got[rank].items():
            assert box == (flat[rank][name] if ".experts." in name else tp2[rank % TP][name]), name


@pytest.mark.parametrize("expert_parallel", [True, False])
def test_fp8_scale_tiles_follow_their_weights(expert_parallel):
    table = fp8_param_table(params(8, hidden=256, ffn=512, mi=512, hd=128, dtype="bfloat16"))
    layout = wide(8) if expert_parallel else GenLayout(tp=TP, attention_dp=D)
    targets = gen_targets(table, layout, model(8))
    scales = [name for name in table if name.endswith("_scale_inv")]
    assert any(".experts." in name for name in scales)
    for name in scales:
        weight = name.removesuffix("_scale_inv")
        shape, _, boxes = targets.params[weight]
        expected = tuple(None if b is None else scale_box(weight, b, shape) for b in boxes)
        assert targets.params[name][2] == expected, name
    if not expert_parallel:
        down = "model.layers.1.mlp.experts.0.down_proj.weight"
        assert targets.params[scale_name(down)][2] == tuple(((0, 2), (i, i + 1)) for i in range(4))


def test_dense_model_data_parallel_ranks_plan_as_replicas():
    table = params(0)
    layout = GenLayout(tp=TP, dp=3, attention_dp=D, expert_parallel=True)
    assert gen_targets(table, layout, model(0)) == gen_targets(table, GenLayout(tp=TP, dp=6), model(0))
    assert gen_target_specs(table, layout, model(0)) == gen_target_specs(table, GenLayout(tp=TP, dp=6), model(0))


def test_holders_and_local_slots_agree_with_the_placement():
    placement = wide(64, 2).placement
    for moe_layer in range(len(MOE_LAYERS)):
        per_expert = holders_per_expert(placement, moe_layer)
        assert per_expert == tuple(ranks_holding(placement, moe_layer, e) for e in range(64))
        for rank in range(4):
            slots = local_slots(placement, rank, moe_layer)
            assert sorted(local for locals_ in slots.values() for local in locals_) == list(
                range(len(slots_of(placement, rank, moe_layer))))
            assert all(rank in per_expert[e] for e in slots)
    names = list(params(8))
    assert moe_layers(names) == {1: 0, 2: 1}
    assert layer_index("model.layers.12.mlp.experts.3.up_proj.weight") == 12
    assert layer_index("backbone.layers.7.mixer.experts.0.up_proj.weight") == 7
    assert layer_index("model.layers.1.self_attn.q_proj.weight") is None


def test_refusals_name_the_value():
    placement = ExpertPlacement(num_logical_experts=8, ep_size=4)
    with pytest.raises(ValueError, match="GenLayout.attention_dp must be a positive int, got 0"):
        GenLayout(tp=2, attention_dp=0)
    with pytest.raises(ValueError, match="placement places experts under expert parallelism"):
        GenLayout(tp=2, attention_dp=2, placement=placement)
    with pytest.raises(ValueError, match=r"placement.ep_size=4 is not the deployment's tp \* attention_dp = 2 \* 1"):
        GenLayout(tp=2, expert_parallel=True, placement=placement)
    with pytest.raises(ValueError, match="GenLayout.placement must be an ExpertPlacement or None, got 4"):
        GenLayout(tp=2, expert_parallel=True, placement=4)
    layout = GenLayout(tp=2, attention_dp=2, expert_parallel=True, placement=placement)
    with pytest.raises(ValueError, match="num_logical_experts=8, the model num_experts=64"):
        gen_targets(params(64), layout, model(64))
    with pytest.raises(ValueError, match="num_logical_experts=8, the model num_experts=0"):
        gen_targets(params(0), layout, model(0))
    three = ExpertPlacement(num_logical_experts=8, ep_size=4, physical_to_logical=(tuple(range(8)),) * 3)
    with pytest.raises(ValueError, match="has 3 physical_to_logical maps, the model 2 MoE layers"):
        gen_targets(params(8), GenLayout(tp=2, attention_dp=2, expert_parallel=True, placement=three), model(8))
    table = params(8) | {"model.layers.1.mlp.experts.8.up_proj.weight": ((MI, H), "float32")}
    with pytest.raises(ValueError, match="experts.8.up_proj.weight: expert 8 out of range for num_experts=8"):
        gen_targets(table, layout, model(8))
    with pytest.raises(ValueError, match="no data-parallel ranks inside a replica: attention_dp must be 1, got 2"):
        gen_targets(params(8), GenLayout(attention_dp=2), model(8), style="full")
    two = ExpertPlacement(num_logical_experts=8, ep_size=4, physical_to_logical=(tuple(range(8)),) * 2)
    no_layer = {"mlp.experts.0.up_proj.weight": ((MI, H), "float32")}
    with pytest.raises(ValueError, match=r"mlp.experts.\*: routed experts without a layer index"):
        gen_targets(no_layer, GenLayout(tp=2, attention_dp=2, expert_parallel=True, placement=two), model(8))


# -- a refit plan into the deployment -----------------------------------------------------------


def megatron_pieces(table, num_experts, *, tp=2, ep=2, dp=2):
    """Train TP x DP ranks (``rank = dp_index * tp + tp_rank``), Megatron's sharding of the dense
    weights (vocab padded to 64 per rank), the routed experts whole over EP = tp ranks (ETP 1):
    expert ``e`` on the ranks of EP rank ``e // (E / ep)``, ``rank % ep``, in every DP replica."""
    column = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    specs = {}
    for rank in range(tp * dp):
        tp_rank, ep_rank = rank % tp, rank % ep
        specs[rank] = []
        for name, (shape, dtype) in table.items():
            if ".experts." in name and ".shared_experts." not in name:
                if expert_of(name) // (num_experts // ep) != ep_rank:
                    continue
                box = full_box(shape)
            elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
                box = box_along(shape, 0, min(64 * tp_rank, V), min(64 * (tp_rank + 1), V))
            elif len(shape) == 1 or name.endswith("mlp.gate.weight"):
                box = full_box(shape)
            else:
                dim = 0 if name.rsplit(".", 2)[-2] in column else 1
                step = shape[dim] // tp
                box = box_along(shape, dim, tp_rank * step, (tp_rank + 1) * step)
            specs[rank].append(ShardSpec(name=name, global_shape=shape, dtype=dtype, box=box,
                                         is_expert=".experts." in name and ".shared_experts." not in name))
    return specs


def test_refit_plan_into_a_wide_deployment_with_redundant_experts():
    table = params(8)
    layout = wide(8, 2, twice_on_rank0=True, dp=2)
    train = megatron_pieces(table, 8)
    gen = gen_target_specs(table, layout, model(8))
    assert sorted(gen) == list(range(8))
    plan = RefitPlan.build(train, gen, bucket_bytes=256)
    assert plan.unused_train_params == ()
    held = {rank: sum(s.numel * ITEMSIZE[s.dtype] for s in specs) for rank, specs in gen.items()}
    assert {rank: plan.bytes_to(rank) for rank in gen} == held
    assert plan.bytes_sent == plan.bytes_minimal == sum(held.values())
    for rank, specs in gen.items():  # every element of every piece exactly once
        covered = {}
        for t in plan.transfers:
            if t.dst_rank == rank:
                covered.setdefault(t.name, []).append(t.global_box)
        assert sorted(covered) == sorted(s.name for s in specs)
        for spec in specs:
            marks = torch.zeros(spec.global_shape, dtype=torch.int32)
            for box in covered[spec.name]:
                marks[tuple(slice(a, b) for a, b in box)] += 1
            inside = marks[tuple(slice(a, b) for a, b in spec.box)]
            assert bool((inside == 1).all()) and int(marks.sum()) == spec.numel, (rank, spec.name)
    gen_ = torch.Generator().manual_seed(0)
    full = {name: torch.randn(shape, generator=gen_) for name, (shape, _) in table.items()}
    local = {rank: {s.name: full[s.name][tuple(slice(a, b) for a, b in s.box)].clone() for s in specs}
             for rank, specs in train.items()}
    got = replay(plan, local)
    for rank, specs in gen.items():
        for spec in specs:
            assert torch.equal(got[rank][spec.name], full[spec.name][tuple(slice(a, b) for a, b in spec.box)])
    # the dry run's path (the compact targets) plans the same bytes, and prepare()'s packed
    # pieces give back targets with the same boxes per rank
    targets = gen_targets(table, layout, model(8))
    assert Assignment.build(train, targets).gen_bytes() == held
    assert gen_targets_of(pack_targets(targets)) == targets


def deepseek_v3_deployment(rng: random.Random) -> GenLayout:
    """One D4 x T2 deployment of DeepSeek-V3's 256 experts + 16 redundant under EPLB, its two MoE
    layers' maps drawn from ``rng``."""
    maps = []
    for _ in range(2):
        row = list(range(256)) + rng.sample(range(256), 16)
        rng.shuffle(row)
        maps.append(tuple(row))
    placement = vllm_placement(num_logical_experts=256, ep_size=8, num_redundant=16, eplb=True,
                               physical_to_logical=tuple(maps))
    return GenLayout(tp=2, attention_dp=4, expert_parallel=True, placement=placement)


def deepseek_v3_reduced():
    """DeepSeek-V3's shipped train layout (TP1 PP16 EP16, its cache) with the dense layer 0 and MoE
    layers 3 and 4 only: every train rank's specs, and the engine's ModelShape."""
    refit, preset, train_layout = load_config(os.path.join(ROOT, "configs", "deepseek-v3.yaml"))
    cache = f"{refit.model}-{train_layout.describe()}-bfloat16.json.gz"
    (path,) = glob.glob(os.path.join(ROOT, "configs", "cache", cache))
    kept = {}
    train = {}
    for rank, specs in derive_all_ranks(train_layout, load_specs(path), num_experts(preset)).items():
        if id(specs) not in kept:
            kept[id(specs)] = [s for s in specs if s.name.startswith(("model.layers.0.", "model.layers.3.",
                                                                      "model.layers.4.")) or ".layers." not in s.name]
        train[rank] = kept[id(specs)]
    shape = ModelShape(num_attention_heads=preset["num_attention_heads"], num_kv_heads=preset["num_key_value_heads"],
                       vocab_size=preset["vocab_size"], num_experts=num_experts(preset))
    return train, shape


def test_refit_plan_from_deepseek_v3_into_a_wide_deployment():
    """DeepSeek-V3's shipped train layout (TP1 PP16 EP16, its cache), the dense layer 0 and MoE
    layers 3 and 4, into one D4 x T2 deployment with 256 + 16 experts under EPLB, permuted maps."""
    train, shape = deepseek_v3_reduced()
    table = {s.name: (s.global_shape, s.dtype) for specs in train.values() for s in specs}
    layout = deepseek_v3_deployment(random.Random(3))
    placement = layout.placement
    targets = gen_targets(table, layout, shape)
    assert len(targets.ranks) == 8
    assignment = Assignment.build(train, targets)
    gen = {rank: specs for ranks, specs in gen_target_classes(table, layout, shape) for rank in ranks}
    plan = RefitPlan.build(train, gen, bucket_bytes=1 << 30)
    expert_bytes = math.prod(table["model.layers.3.mlp.experts.0.up_proj.weight"][0]) * 2 * 3
    for rank in range(8):
        distinct = sum(len({e for _, e in slots_of(placement, rank, m)}) for m in range(2))
        dense = sum(s.numel * ITEMSIZE[s.dtype] for s in gen[rank] if not s.is_expert)
        assert plan.bytes_to(rank) == assignment.gen_bytes()[rank] == dense + distinct * expert_bytes
    assert plan.bytes_sent == plan.bytes_minimal
