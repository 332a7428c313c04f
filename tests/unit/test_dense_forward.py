"""``refit.gen_dense_forward: node``'s pure part (#64 item 2): which engine ranks of a deployment form
a node group, how a dense shard's rows split over it (whole 128-row tiles, a ``scale_inv`` at the
same tiles), and what each rank then takes from the train ranks. The exchange itself runs in
``tests/megatron/test_wide_ep_refit.py`` (bit-exact, corrupted rows named)."""

from __future__ import annotations

import pytest

from megatron_refit.plan.dense_forward import DenseForward, node_group, split
from megatron_refit.plan.spec import ShardSpec


def _spec(name, rows, cols=64, start=0, dtype="bfloat16"):
    return ShardSpec(name=name, global_shape=(start + rows, cols), dtype=dtype, box=((start, start + rows), (0, cols)))


@pytest.mark.parametrize("gen_index, tp, dp, node_ranks, group", [
    (0, 1, 4, 2, (0, 1)), (3, 1, 4, 2, (2, 3)),  # D4 x T1, two a node
    (1, 2, 4, 8, (1, 3, 5, 7)),  # D4 x T2 on one node of 8: TP rank 1 of every DP rank
    (5, 2, 4, 4, (5, 7)),  # two nodes of 4: DP ranks 2 and 3 on the second
    (9, 2, 2, 4, (9, 11)),  # the second deployment of D2 x T2 (engine ranks 8..11)
    (2, 8, 2, 8, (2,)),  # T8 fills a node: one DP rank a node, no group
])
def test_node_groups_are_the_dp_ranks_of_a_tp_rank_on_one_node(gen_index, tp, dp, node_ranks, group):
    assert node_group(gen_index, tp=tp, attention_dp=dp, node_ranks=node_ranks) == group


def test_rows_split_at_whole_tiles_and_a_scale_inv_at_the_same_tiles():
    weight, scale = _spec("model.layers.0.self_attn.q_proj.weight", 7 * 128 + 5), \
        _spec("model.layers.0.self_attn.q_proj.weight_scale_inv", 8, cols=1, dtype="float32")
    rows = split(weight, 3)
    assert rows == ((0, 384), (384, 768), (768, 901))
    assert split(scale, 3) == ((0, 3), (3, 6), (6, 8))  # tile t of the weight is row t of its scale
    assert [(a // 128, -(-b // 128)) for a, b in rows] == list(split(scale, 3))
    assert split(_spec("model.norm.weight", 100), 4) == ((0, 100), (100, 100), (100, 100), (100, 100))


def test_each_rank_takes_its_rows_of_the_dense_pieces_and_every_expert_whole():
    specs = [_spec("model.layers.0.self_attn.o_proj.weight", 512, start=512),  # TP rank 1's half
             _spec("model.layers.0.mlp.experts.3.down_proj.weight", 256),
             _spec("model.norm.weight", 64)]
    forward = DenseForward.of(specs, (4, 6), 6)
    assert forward.position == 1 and forward.peers() == (4,)
    assert set(forward.rows) == {"model.layers.0.self_attn.o_proj.weight", "model.norm.weight"}
    narrowed = {spec.name: spec.box for spec in forward.narrow(specs)}
    assert narrowed == {"model.layers.0.self_attn.o_proj.weight": ((768, 1024), (0, 64)),  # its global rows
                        "model.layers.0.mlp.experts.3.down_proj.weight": ((0, 256), (0, 64))}  # the norm: none left
    first = DenseForward.of(specs, (4, 6), 4).narrow(specs)
    assert [spec.box[0] for spec in first] == [(512, 768), (0, 256), (0, 64)]
    with pytest.raises(ValueError, match=r"engine rank 5 is not in its node group \[4, 6\]"):
        DenseForward.of(specs, (4, 6), 5)
    with pytest.raises(ValueError, match="node_ranks must be a positive int, got 0"):
        node_group(0, tp=1, attention_dp=2, node_ranks=0)


def test_a_name_held_in_two_boxes_goes_whole_and_a_group_of_one_forwards_nothing():
    specs = [_spec("model.embed_tokens.weight", 256), _spec("model.embed_tokens.weight", 256, start=512)]
    assert DenseForward.of(specs, (0, 1), 0).narrow(specs) == specs
    assert DenseForward.of(specs[:1], (3,), 3).rows == {}
