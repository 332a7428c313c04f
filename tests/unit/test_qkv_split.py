"""Local QKV split: Bridge's split_qkv_weights on per-rank head counts, and its limits."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conversion.local_shards import LocalSplitError, qkv_local_pieces, split_qkv_rows
from conversion.te_shim import import_bridge

import_bridge()
from megatron.bridge.models.conversion.param_mapping import (  # noqa: E402
    merge_qkv_weights,
    split_qkv_biases,
    split_qkv_weights,
)


def _cfg(heads, groups, head_dim=4, hidden=8):
    return SimpleNamespace(
        num_attention_heads=heads, num_query_groups=groups, kv_channels=head_dim, hidden_size=hidden,
        attention_output_gate=False,
    )


@pytest.mark.parametrize("heads,groups,tp", [(4, 2, 1), (4, 2, 2), (8, 4, 4), (8, 8, 2), (6, 3, 3)])
def test_local_split_equals_slices_of_global_split(heads, groups, tp):
    cfg = _cfg(heads, groups)
    hd, hidden = cfg.kv_channels, cfg.hidden_size
    q, k, v = torch.randn(heads * hd, hidden), torch.randn(groups * hd, hidden), torch.randn(groups * hd, hidden)
    fused = merge_qkv_weights(cfg, q, k, v)
    assert all(torch.equal(a, b) for a, b in zip(split_qkv_weights(cfg, fused), (q, k, v)))
    local_rows = fused.shape[0] // tp
    for rank in range(tp):
        local = fused[rank * local_rows:(rank + 1) * local_rows]  # Megatron's column-parallel shard
        pieces = qkv_local_pieces(cfg, tp, rank, local)
        first = pieces["q"][2]()
        for key, ref in zip("qkv", (q, k, v)):
            global_shape, box, get, release = pieces[key]
            assert global_shape == tuple(ref.shape)
            assert torch.equal(get(), ref[box[0][0]:box[0][1]])
            release()  # each piece drops its own part; the others stay cached
            assert torch.equal(get(), ref[box[0][0]:box[0][1]])  # a released part is split again
            release()
        assert pieces["q"][2]() is not first


def test_tp_beyond_kv_heads_is_refused_not_mis_split():
    cfg = _cfg(heads=8, groups=2)
    local = torch.randn((8 + 2 * 2) * 4 // 4, 8)
    with pytest.raises(LocalSplitError, match="tensor-parallel size 4 does not divide num_query_groups=2"):
        qkv_local_pieces(cfg, 4, 0, local)


@pytest.mark.parametrize("heads,groups", [(4, 2), (8, 1), (6, 3), (4, 4)])
@pytest.mark.parametrize("kind", ["weight", "bias", "lora_b", "scale_tile"])
def test_row_split_equals_bridge_split(heads, groups, kind):
    """Our strided row split gives Bridge's q, k, v exactly, for every tensor the QKV split sees."""
    head_dim, hidden = 256, 512
    cfg = _cfg(heads, groups, head_dim=head_dim, hidden=hidden)
    rows = (heads + 2 * groups) * head_dim
    tensor = {"weight": torch.randn(rows, hidden), "bias": torch.randn(rows), "lora_b": torch.randn(rows, 3),
              "scale_tile": torch.randn(rows // 128, hidden // 128)}[kind]
    if kind == "bias":
        ref = split_qkv_biases(cfg, tensor)
    elif kind == "lora_b":
        ref = split_qkv_weights(cfg, tensor, feature_dim=3)
    else:
        ref = split_qkv_weights(cfg, tensor)  # a scale tile: Bridge infers the 128 divisor
    got = split_qkv_rows(tensor, heads, groups)
    assert all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(got, ref))
    if groups == 1:  # contiguous: views of the fused tensor, no copy
        assert all(g.data_ptr() >= tensor.data_ptr() and g._base is not None for g in got)
