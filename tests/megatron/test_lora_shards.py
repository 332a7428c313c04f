"""LoRA adapters as local shards (no gather): our pieces of every adapter equal Bridge's own
gathered adapter export, and the wrapped model's base pieces equal the export before wrapping."""

from __future__ import annotations

import pytest
import torch

from megatron_refit.local.launch import run_spawned
from megatron_refit.testing import workers

pytestmark = pytest.mark.slow

CASES = [("qwen3", dict(tp=2)), ("qwen3", dict(pp=2))]


def _assemble(pieces):
    full = {}
    for spec, tensor in pieces:
        t = full.setdefault(spec.name, torch.full(spec.global_shape, float("nan"), dtype=tensor.dtype))
        t[tuple(slice(a, b) for a, b in spec.box)] = tensor
    return full


def test_adapter_and_base_pieces_equal_bridge_exports():
    out = run_spawned(workers.lora_cases, 2, CASES, timeout_s=300)
    for i, (_model, layout) in enumerate(CASES):
        ours = _assemble([p for rank in out for p in rank[i]["ours"]])
        adapters = out[0][i]["adapters"]
        assert adapters and set(ours) == set(adapters), (layout, set(ours) ^ set(adapters))
        for name, tensor in adapters.items():
            assert torch.equal(ours[name], tensor), (layout, name)
        assert any(n.endswith("k_proj.lora_B.weight") for n in ours) and any(n.endswith("up_proj.lora_A.weight")
                                                                           for n in ours)
        base = _assemble([p for rank in out for p in rank[i]["base"]])
        export = out[0][i]["export"]
        assert set(base) == set(export)
        for name, tensor in export.items():
            assert torch.equal(base[name], tensor), (layout, name)
