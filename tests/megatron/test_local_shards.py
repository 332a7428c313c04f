"""Local HF shards from Bridge's conversion tasks vs Bridge's own gathered export.

Each spawned group re-initialises several layouts, so Bridge's import cost is paid once
per group. The oracle: all ranks' pieces, placed by their boxes, equal
``export_hf_weights`` bit for bit; distinct boxes tile every tensor exactly once; replicas
agree; the meta-device enumeration gives the same specs; no collective is issued.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from megatron_refit.local.launch import run_spawned
from megatron_refit.plan.spec import intersect
from megatron_refit.testing import workers

pytestmark = pytest.mark.slow

WORLD1 = [("qwen3", {}, False), ("qwen3-moe", {}, False)]
WORLD2 = [
    ("qwen3", dict(tp=2), True),
    ("qwen3", dict(pp=2), False),
    ("qwen3-moe", dict(ep=2, dp=2), False),
    ("qwen3-moe", dict(tp=2, etp=2), True),
]
WORLD4 = [
    ("qwen3", dict(tp=2, pp=2), True),
    ("qwen3-moe", dict(tp=2, ep=2, dp=2), False),
    ("qwen3-moe", dict(tp=2, pp=2, ep=2, etp=1), False),
]
GROUPS = {1: WORLD1, 2: WORLD2, 4: WORLD4}
VOCAB_NAMES = ("model.embed_tokens.weight", "lm_head.weight")
VOCAB = 250


def case_id(case):
    model, kw, pad = case
    tag = "x".join(f"{k.upper()}{v}" for k, v in kw.items()) or "world1"
    return f"{model}-{tag}" + ("-padvocab" if pad else "")


@pytest.fixture(scope="module")
def group_results():
    """{world_size: per-rank lists of per-case results}, spawned lazily once per module."""
    cache = {}

    def get(world):
        if world not in cache:
            cache[world] = run_spawned(workers.enumerate_cases, world, GROUPS[world], timeout_s=420)
        return cache[world]

    return get


ALL_CASES = [(w, i, c) for w, cases in GROUPS.items() for i, c in enumerate(cases)]


def _case(group_results, world, index):
    """Per-rank results of one case, with layout completed by dp."""
    ranks = group_results(world)
    return [r[index] for r in ranks]


def _with_dp(world, kw):
    kw = dict(kw)
    kw.setdefault("dp", world // (kw.get("tp", 1) * kw.get("pp", 1)))
    return kw


@pytest.mark.parametrize("world,index,case", ALL_CASES, ids=[case_id(c) for _, _, c in ALL_CASES])
def test_local_shards_reassemble_to_bridge_export(group_results, world, index, case):
    per_rank = _case(group_results, world, index)
    export = per_rank[0]["export"]
    pieces: dict[str, dict] = {}
    for rank, res in enumerate(per_rank):
        for spec, tensor in res["real"]:
            assert tuple(tensor.shape) == spec.shape, spec
            assert str(tensor.dtype).removeprefix("torch.") == spec.dtype
            byname = pieces.setdefault(spec.name, {})
            if spec.box in byname:  # a replica: same values as the first holder
                other_spec, other = byname[spec.box]
                assert other_spec == spec
                assert torch.equal(other, tensor), f"replicas of {spec.name} {spec.box} differ (rank {rank})"
            else:
                byname[spec.box] = (spec, tensor)
    assert set(pieces) == set(export), (set(pieces) ^ set(export))
    for name, boxes in pieces.items():
        specs = [s for s, _ in boxes.values()]
        global_shape = specs[0].global_shape
        ref = export[name]
        if name in VOCAB_NAMES and ref.shape[0] > global_shape[0]:
            # Bridge's export keeps Megatron's vocab padding rows; HF tensors have none.
            assert global_shape[0] == VOCAB
            ref = ref[:VOCAB]
        assert tuple(ref.shape) == global_shape, name
        # distinct boxes tile the tensor exactly once
        assert sum(s.numel for s in specs) == math.prod(global_shape), name
        for i, a in enumerate(specs):
            for b in specs[i + 1:]:
                assert intersect(a.box, b.box) is None, (name, a.box, b.box)
        for spec, tensor in boxes.values():
            window = ref[tuple(slice(lo, hi) for lo, hi in spec.box)]
            assert torch.equal(window, tensor), f"{name} box {spec.box} differs from Bridge export"
        is_expert = re.search(r"\.experts\.\d+\.", name) is not None
        assert all(s.is_expert == is_expert for s in specs), name


@pytest.mark.parametrize("world,index,case", ALL_CASES, ids=[case_id(c) for _, _, c in ALL_CASES])
def test_meta_specs_equal_real_specs(group_results, world, index, case):
    for rank, res in enumerate(_case(group_results, world, index)):
        assert res["meta"] == [spec for spec, _ in res["real"]], f"rank {rank}"
        assert res["meta_devices"] == {"meta"}


@pytest.mark.parametrize("world,index,case", ALL_CASES, ids=[case_id(c) for _, _, c in ALL_CASES])
def test_shards_are_views_except_qkv(group_results, world, index, case):
    """Every piece is a view of its Megatron parameter, except q/k/v where a rank holds
    several query groups (their rows interleave: one copy each)."""
    from conversion.presets import hf_config

    model, kw, _ = case
    one_group = hf_config(model).num_key_value_heads // kw.get("tp", 1) == 1
    for res in _case(group_results, world, index):
        for (spec, _), is_view in zip(res["real"], res["views"]):
            expect_view = one_group or not re.search(r"\.self_attn\.[qkv]_proj\.", spec.name)
            assert is_view == expect_view, spec.name


MOE_CASES = [(w, i, c) for w, i, c in ALL_CASES if c[0] == "qwen3-moe"]


@pytest.mark.parametrize("world,index,case", MOE_CASES, ids=[case_id(c) for _, _, c in MOE_CASES])
def test_grouped_expert_view(group_results, world, index, case):
    per_rank = _case(group_results, world, index)
    export = per_rank[0]["export"]
    grouped: dict[str, torch.Tensor] = {}
    for res in per_rank:
        for spec, tensor in res["grouped"]:
            out = grouped.setdefault(spec.name, torch.full(spec.global_shape, float("nan")))
            out[tuple(slice(lo, hi) for lo, hi in spec.box)] = tensor
    assert grouped
    for name, tensor in grouped.items():
        prefix, proj = re.fullmatch(r"(.*\.experts)\.(.*)", name).groups()
        ref = torch.stack([export[f"{prefix}.{e}.{proj}"] for e in range(tensor.shape[0])])
        assert torch.equal(tensor, ref), name


def _fake_world_specs(rank, world_size, port, cases, every_rank):
    from conversion.presets import hf_config
    from conversion.testing.meta import all_rank_shard_specs, rank_shard_specs
    from megatron_refit.plan.layout import TrainLayout

    out = []
    for model, kw, world in cases:
        layout = TrainLayout(**_with_dp(world, kw))
        cfg = hf_config(model)
        if every_rank:
            out.append({r: rank_shard_specs(cfg, layout, r) for r in range(layout.world_size)})
        else:
            out.append(all_rank_shard_specs(cfg, layout))
    return out


@pytest.mark.parametrize("every_rank", [False, True], ids=["representatives", "every-rank"])
def test_all_rank_specs_from_one_process(group_results, every_rank):
    """Specs of every rank, computed in one process with a fake process group, equal what
    the real ranks enumerated."""
    cases = [(m, kw, w) for w in (2, 4) for m, kw, pad in GROUPS[w] if not pad]
    fake = run_spawned(_fake_world_specs, 1, cases, every_rank, timeout_s=300)[0]
    for (model, kw, world), specs_by_rank in zip(cases, fake):
        index = next(i for i, c in enumerate(GROUPS[world]) if c[0] == model and c[1] == kw)
        per_rank = _case(group_results, world, index)
        assert sorted(specs_by_rank) == list(range(world))
        for rank, res in enumerate(per_rank):
            assert specs_by_rank[rank] == [s for s, _ in res["real"]], (model, kw, rank)
