"""FP8 ``*_scale_inv`` siblings at mapping level (TE cannot create FP8 params on CPU): local
scale pieces through Bridge's ``_HFNameSuffixMapping`` equal Bridge's gathered export of the
same tasks, QKV scale split included."""

from __future__ import annotations

import pytest
import torch

from megatron_refit.local.launch import run_spawned
from megatron_refit.testing import workers

pytestmark = pytest.mark.slow

CASES = [("qwen3", dict(tp=2)), ("qwen3-moe", dict(tp=2, etp=2))]


def test_scale_inv_pieces_equal_bridge_export():
    out = run_spawned(workers.scale_inv_cases, 2, CASES, timeout_s=300)
    for i, (model, _kw) in enumerate(CASES):
        bridge = out[0][i]["bridge"]
        assert bridge and all(name.endswith("_scale_inv") for name in bridge)
        assembled = {}
        for rank in out:
            for spec, tensor in rank[i]["ours"]:
                assert spec.name.endswith("_scale_inv")
                full = assembled.setdefault(spec.name, torch.full(spec.global_shape, float("nan")))
                full[tuple(slice(a, b) for a, b in spec.box)] = tensor
        assert set(assembled) == set(bridge), set(assembled) ^ set(bridge)
        for name, tensor in assembled.items():
            assert torch.equal(tensor, bridge[name]), (model, name)
        assert any(".self_attn.k_proj.weight_scale_inv" in n for n in bridge)
