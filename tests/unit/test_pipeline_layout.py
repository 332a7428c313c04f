"""The pure pipeline-layout rules (:mod:`megatron_refit.plan.pipeline_layout`); their agreement
with Megatron's own code is tests/megatron/test_pipeline_layout.py."""

from __future__ import annotations

import pytest

from megatron_refit.plan import pipeline_layout as pl
from megatron_refit.plan.layout import TrainLayout


def test_string_and_list_forms_parse_alike():
    stages = pl.parse_layout("Et*2|(t|)*2,t*2|t|tmL", 2)  # (…)*n and x*n unrolled, commas cosmetic
    assert stages == (("embedding", "decoder", "decoder"), ("decoder",), ("decoder",), ("decoder", "decoder"),
                      ("decoder",), ("decoder", "mtp", "loss"))
    assert TrainLayout(pp=2, layout=stages, mtp_layers=1).vpp == 3
    listed = pl.parse_layout([list(s) for s in stages], 2)
    assert listed == stages
    assert pl.parse_layout(pl.layout_text(stages), 2) == stages


def test_layout_text_round_trip_of_a_recipe():
    kimi = [["embedding"] + ["decoder"] * 4] + [["decoder"] * 4] * 14 + [["decoder", "loss"]]
    stages = pl.parse_layout(kimi, 16)
    assert pl.layout_text(stages).startswith("Et*4|t*4|") and pl.layout_text(stages).endswith("|tL")
    assert pl.parse_layout(pl.layout_text(stages), 16) == stages


@pytest.mark.parametrize("value, match", [
    ("Et|tQ", r"unknown layer character\(s\) \['Q'\]"),
    ([["embedding", "transformer"], ["loss"]], r"'transformer' is not a layer type"),
    (7, r"expected a string or a list of lists"),
    ("Et|t|tL", r"3 stages do not divide over pipeline_model_parallel_size=2"),
])
def test_bad_layouts_name_the_key(value, match):
    with pytest.raises(ValueError, match=rf"model\.pipeline_model_parallel_layout.*{match}"):
        pl.parse_layout(value, 2)


def test_layout_checks_as_megatron():
    layout = TrainLayout(pp=2, layout="Et|tL", mtp_layers=0)
    layout.chunk_layers(2)
    with pytest.raises(ValueError, match=r"MTP layers must be in the last virtual stage"):
        TrainLayout(pp=2, layout="Et|tm||L", mtp_layers=1).chunk_layers(2)
    with pytest.raises(ValueError, match=r"decoder layers must come before the MTP layers"):
        TrainLayout(pp=2, layout="Et|mtL", mtp_layers=1).chunk_layers(2)
    with pytest.raises(ValueError, match=r"the first layer must be embedding and the last loss"):
        TrainLayout(pp=2, layout="t|tL").chunk_layers(2)


def test_context_parallel_ranks_hold_what_data_parallel_ranks_hold():
    layout = TrainLayout(tp=2, cp=2, dp=2, pp=2, ep=4)
    assert layout.world_size == 16 and layout.expert_dp == 2
    holders: dict[tuple, list] = {}
    for rank in range(layout.world_size):
        c = layout.coordinates(rank)
        holders.setdefault((c["tp"], c["pp"]), []).append((c["cp"], c["dp"]))
    # each dense piece (TP rank, PP stage) is held by every (CP, DP) pair: 4 holders share its sends
    assert all(sorted(h) == [(0, 0), (0, 1), (1, 0), (1, 1)] for h in holders.values()) and len(holders) == 4
