"""Transformer Engine FP8 pass-through at mapping level (TE cannot create FP8 params on CPU):
Float8Blockwise stand-ins (TE's ``get_metadata()`` layout: uint8 data, scale columns padded
to a multiple of 4) in place of the linear weights of real tiny Megatron models. Our local
FP8 data + trimmed ``weight_scale_inv`` pieces must equal Bridge's gathered export of the
same tasks byte for byte, and — shards being on the 128 grid — quantizing Bridge's full
export with TE's power-of-two scales."""

from __future__ import annotations

import pytest
import torch

from megatron_refit.plan.fp8_layout import is_quantized, scale_name
from megatron_refit.endpoint.fp8 import quantize_blockwise
from megatron_refit.local.launch import run_spawned
from megatron_refit.testing import workers

pytestmark = pytest.mark.slow

CASES = [("qwen3", dict(tp=2)), ("qwen3-moe", dict(tp=2, ep=2))]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_te_pass_through_equals_bridge_export_of_te_bytes():
    out = run_spawned(workers.te_fp8_cases, 2, CASES, timeout_s=300)
    for i, (model, _) in enumerate(CASES):
        bridge, export = out[0][i]["bridge"], out[0][i]["export"]
        assembled = {}
        for rank in out:
            for spec, tensor in rank[i]["ours"]:
                full = assembled.setdefault(spec.name, torch.zeros(spec.global_shape, dtype=tensor.dtype))
                full[tuple(slice(a, b) for a, b in spec.box)] = tensor
        assert set(assembled) == set(bridge), set(assembled) ^ set(bridge)
        quantized = [n for n in export if is_quantized(n, tuple(export[n].shape))]
        assert quantized and all(assembled[n].dtype == torch.float8_e4m3fn for n in quantized)
        for name, tensor in assembled.items():
            assert torch.equal(_bytes(tensor), _bytes(bridge[name])), (model, name)
        for name in quantized:
            q, s = quantize_blockwise(export[name], pow2_scales=True)
            assert torch.equal(_bytes(assembled[name]), _bytes(q)), (model, name)
            assert torch.equal(assembled[scale_name(name)], s), (model, name)
        assert not any(n.endswith("mlp.gate.weight_scale_inv") for n in assembled)  # router stays as trained


def test_te_shards_off_the_grid_or_without_scales_are_refused():
    from conversion.te_fp8 import check_fp8_specs
    from megatron_refit.plan.spec import ShardSpec

    name = "model.layers.0.mlp.down_proj.weight"
    weight = ShardSpec(name=name, global_shape=(256, 320), dtype="float8_e4m3fn", box=((0, 256), (160, 320)))
    scale = ShardSpec(name=name + "_scale_inv", global_shape=(2, 3), dtype="float32", box=((0, 2), (1, 3)))
    with pytest.raises(ValueError, match=rf"{name}: shard boundary 160 in dim 1 \(size 320\)"):
        check_fp8_specs([weight, scale])
    with pytest.raises(ValueError, match=rf"{name}: FP8 weight without its _scale_inv tiles"):
        check_fp8_specs([weight])
