"""``swap: staged`` in vLLM, ready for a GPU (#49 item 5), checked without one: on CUDA every
tensor the swap hands a live module is copied into the live storage (captured CUDA graphs hold
its address), so a post-load tensor whose shape, dtype or device changed, or that has no live
tensor to go into, is refused by name before the swap (the version then loads under the pause);
and a shadow over ``refit.swap_budget_mb`` is not made. ``graph_bound`` (``tensor.is_cuda``) is
patched to treat these CPU tensors as a GPU's. Pure torch: no vLLM, no process."""

from __future__ import annotations

import pytest
import torch

from megatron_refit.engines.vllm.worker import prepare as p


def _pair(**shadow_tensors) -> tuple[p._Pair, dict]:
    live = torch.nn.Linear(4, 4)
    shadow = p._shadow(live)[0]
    pair = p._Pair(live, shadow)
    for name, tensor in shadow_tensors.items():
        shadow._parameters[name] = tensor
    return pair, {id(shadow): "model.layers.0.mlp.down_proj"}


@pytest.fixture
def on_gpu(monkeypatch):
    monkeypatch.setattr(p, "graph_bound", lambda tensor: True)


def test_a_post_load_tensor_of_the_live_shape_and_dtype_is_copyable(on_gpu):
    pair, names = _pair(weight=torch.nn.Parameter(torch.zeros(4, 4)))
    p.check_copyable([pair], names)  # the swap copies it into the live storage


@pytest.mark.parametrize("tensor, made", [
    (torch.zeros(4, 8), "(4, 8) torch.float32 on cpu"),  # repacked to another shape
    (torch.zeros(4, 4, dtype=torch.bfloat16), "(4, 4) torch.bfloat16 on cpu"),
])
def test_a_post_load_tensor_that_changed_shape_or_dtype_is_refused_by_name_on_a_gpu(on_gpu, tensor, made):
    pair, names = _pair(weight=tensor)
    with pytest.raises(p.NotPreparableError, match=r"vLLM layer model.layers.0.mlp.down_proj: its post-load step "
                                                   rf"made weight {made.replace('(', r'\(').replace(')', r'\)')} "
                                                   r"where the live one is \(4, 4\) torch.float32 on cpu"):
        p.check_copyable([pair], names)


def test_a_post_load_tensor_with_no_live_tensor_to_go_into_is_refused_on_a_gpu(on_gpu):
    pair, names = _pair(packed=torch.zeros(16))
    with pytest.raises(p.NotPreparableError, match="made packed .* where the live one is none"):
        p.check_copyable([pair], names)


def test_on_cpu_a_changed_tensor_is_swapped_by_reference():
    pair, names = _pair(weight=torch.zeros(4, 8))
    p.check_copyable([pair], names)  # no graph holds CPU addresses: the reference swap is right
    pair.take_over()
    assert tuple(pair.live.weight.shape) == (4, 8)


def test_a_shadow_over_the_budget_is_not_made():
    model = torch.nn.Linear(256, 256)  # 257 KiB of float32
    with pytest.raises(p.NotPreparableError, match=r"its shadow would take about 0.3 MiB, over the 0.1 MiB "
                                                   "refit.swap_budget_mb leaves beside the staging buffers"):
        p.prepare(model, lambda shadow: None, first_load_setup=None, budget_bytes=100 << 10)
