"""Which layers each (pipeline rank, virtual stage) holds: :meth:`TrainLayout.chunk_layers` and
:meth:`TrainLayout.mtp_stages` against Megatron-Core's own code (``TransformerConfig`` with its
validation, ``get_transformer_layer_offset``, ``get_num_layers_to_build``,
``get_mtp_num_layers_to_build``), on the recipes' settings and the corner cases of each rule.
The layers a built model chunk holds are checked against the same in ``test_recipe_layouts.py``."""

from __future__ import annotations

import pytest
import torch

from megatron_refit.plan.layout import TrainLayout

KIMI_PP16 = [["embedding"] + ["decoder"] * 4] + [["decoder"] * 4] * 14 + [["decoder", "loss"]]
DSV3_PP16 = [["embedding"] + ["decoder"] * 4] + [["decoder"] * 4] * 14 + [["decoder", "mtp", "loss"]]
DSV3_PP8_VPP2 = DSV3_PP16  # the recipe's (8, 2) entry: the same 16 stages over 8 ranks

# (num_layers, TrainLayout kwargs): the recipes' layouts, then each rule's corners
CASES = [
    (61, dict(pp=16, layout=DSV3_PP16, mtp_layers=1)),  # deepseek_v3 1024-GPU recipe
    (61, dict(pp=8, layout=DSV3_PP8_VPP2, mtp_layers=1)),  # its PP8 x VPP2 entry
    (61, dict(pp=16, layout=KIMI_PP16)),  # kimi_k2
    (94, dict(pp=16, account_for_embedding=True, account_for_loss=True)),  # qwen3-235b-a22b
    (48, dict(pp=2)),  # qwen3-30b-a3b
    (80, dict(pp=4, vpp=5)),  # llama3-70b
    (126, dict(pp=8, vpp=2, account_for_embedding=True, account_for_loss=True)),  # llama3.1-405b
    (36, dict(pp=2, vpp=2)),
    (48, dict(pp=2, layout="Et*20|t*28L")),
    (9, dict(pp=2, layout="Et|(tt|)*3,t|tL")),  # string form with a repeated group: 2 ranks x 3 stages
    (16, dict(pp=4, vpp=2, first_stage_layers=2, last_stage_layers=2)),
    (16, dict(pp=4, vpp=2, first_stage_layers=4)),
    (61, dict(pp=16, first_stage_layers=3, last_stage_layers=2)),
    (10, dict(pp=3, last_stage_layers=2)),
    (6, dict(pp=2, vpp=3, mtp_layers=2)),
    (7, dict(pp=4, account_for_embedding=True)),
]


def _megatron(num_layers: int, layout: TrainLayout) -> tuple[dict, dict]:
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.multi_token_prediction import get_mtp_num_layers_to_build
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    raw = None
    if layout.layout is not None:  # Megatron parses the list form itself
        raw = [list(stage) for stage in layout.layout]
    config = TransformerConfig(
        num_layers=num_layers, hidden_size=8, num_attention_heads=2, pipeline_dtype=torch.float32,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=None if layout.layout is not None else layout.vpp,
        num_layers_in_first_pipeline_stage=layout.first_stage_layers,
        num_layers_in_last_pipeline_stage=layout.last_stage_layers,
        account_for_embedding_in_pipeline_split=layout.account_for_embedding,
        account_for_loss_in_pipeline_split=layout.account_for_loss,
        pipeline_model_parallel_layout=raw, mtp_num_layers=layout.mtp_layers or None)
    vpp = config.virtual_pipeline_model_parallel_size
    layers, mtp = {}, {}
    try:
        ps.set_virtual_pipeline_model_parallel_world_size(vpp)
        ps.set_pipeline_model_parallel_world_size(layout.pp)
        for rank in range(layout.pp):
            ps.set_pipeline_model_parallel_rank(rank)
            for vp in range(vpp or 1):
                stage = vp if vpp else None
                offset = get_transformer_layer_offset(config, vp_stage=stage, pp_rank=rank)
                layers[rank, vp] = range(offset, offset + get_num_layers_to_build(config, vp_stage=stage,
                                                                                   pp_rank=rank))
                if layout.mtp_layers and (count := get_mtp_num_layers_to_build(config, vp_stage=stage)):
                    mtp[rank, vp] = count
    finally:
        ps.set_virtual_pipeline_model_parallel_world_size(None)
        ps.set_pipeline_model_parallel_world_size(None)
        ps.set_pipeline_model_parallel_rank(None)
    return layers, mtp


@pytest.mark.parametrize("num_layers, kw", CASES, ids=[f"{n}-{'-'.join(map(str, k))}-{i}"
                                                     for i, (n, k) in enumerate(CASES)])
def test_layers_per_chunk_are_megatrons(num_layers, kw):
    layout = TrainLayout(**kw)
    layers, mtp = _megatron(num_layers, layout)
    ours = layout.chunk_layers(num_layers)
    assert {k: list(v) for k, v in ours.items()} == {k: list(v) for k, v in layers.items()}
    assert layout.mtp_stages() == mtp
    # every decoder layer once
    assert sorted(i for r in ours.values() for i in r) == list(range(num_layers))


def test_virtual_pipeline_interleaves_as_megatron():
    """The issue's example: PP2 x VPP2 over 36 layers is 0-8,18-26 | 9-17,27-35 (not 0-17 | 18-35)."""
    chunks = TrainLayout(pp=2, vpp=2).chunk_layers(36)
    assert (chunks[0, 0], chunks[0, 1], chunks[1, 0], chunks[1, 1]) == (range(0, 9), range(18, 27), range(9, 18),
                                                                         range(27, 36))
    assert TrainLayout(pp=2, layout="Et*20|t*28L").stage_layers(48) == [20, 28]


@pytest.mark.parametrize("num_layers, kw, match", [
    (36, dict(pp=5), r"num_layers=36 does not split over pipeline_model_parallel_size=5"),
    (61, dict(pp=16, layout=KIMI_PP16, mtp_layers=1), r"pipeline_model_parallel_layout holds 0 mtp layers, "
                                                        r"mtp_num_layers is 1"),
    (60, dict(pp=16, layout=KIMI_PP16), r"pipeline_model_parallel_layout holds 61 decoder layers, the model has "
                                        r"num_layers=60"),
    (36, dict(pp=4, vpp=2), r"9 layers per pipeline rank do not split over virtual_pipeline_model_parallel_size=2"),
    (16, dict(pp=4, vpp=2, first_stage_layers=3), r"num_layers_in_first_pipeline_stage=3 does not split over "
                                                  r"virtual_pipeline_model_parallel_size=2"),
])
def test_layouts_megatron_refuses_are_refused_naming_the_key(num_layers, kw, match):
    with pytest.raises((ValueError, AssertionError)):
        _megatron(num_layers, TrainLayout(**kw))
    with pytest.raises(ValueError, match=match):
        TrainLayout(**kw).chunk_layers(num_layers)


@pytest.mark.parametrize("kw", [dict(tp=2, cp=2, dp=2, pp=2, ep=4), dict(tp=4, cp=2, dp=1, pp=2, ep=2, etp=2),
                                dict(tp=2, cp=2, dp=4, pp=1, ep=8), dict(tp=1, cp=4, dp=2, pp=3)])
def test_rank_coordinates_are_megatrons_rank_generator(kw):
    """Context parallelism in Megatron's rank order: every rank's (tp, cp, dp, pp) and expert
    (etp, ep, edp) coordinates, from the groups of Megatron's own ``RankGenerator``."""
    from megatron.core.parallel_state import RankGenerator

    layout = TrainLayout(**kw)
    dense = RankGenerator(tp=layout.tp, ep=1, dp=layout.dp, pp=layout.pp, cp=layout.cp, order="tp-cp-ep-dp-pp")
    expert = RankGenerator(tp=layout.etp, ep=layout.ep, dp=layout.expert_dp, pp=layout.pp, cp=1,
                           order="tp-cp-ep-dp-pp")
    assert dense.world_size == expert.world_size == layout.world_size
    found: dict[int, dict] = {r: {} for r in range(layout.world_size)}
    for generator, axes in ((dense, {"tp": "tp", "cp": "cp", "dp": "dp", "pp": "pp"}),
                            (expert, {"tp": "etp", "ep": "ep", "dp": "edp"})):
        for token, name in axes.items():
            for group in generator.get_ranks(token):
                for index, rank in enumerate(group):
                    found[rank][name] = index
    for rank in range(layout.world_size):
        assert layout.coordinates(rank) == found[rank], rank
