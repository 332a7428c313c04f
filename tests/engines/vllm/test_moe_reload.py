"""``megatron_refit.engines.vllm.worker.moe_reload`` against vLLM 0.33's own classes: which fused-MoE
layers a reload sets up again (those whose experts' post-load step vLLM skips on a weight update:
CPU's prepacking experts, not Triton's), that a layer the reload did not process gets its kernel
back, and that an unquantized MoE method without ``moe_kernel`` is refused by name. (The running
server's MoE refits, with and without this, are ``tests/engines/vllm_server/test_vllm_server_moe.py``.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")


def _layer(experts_cls):
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    method = object.__new__(UnquantizedFusedMoEMethod)  # vLLM's class; its CUDA-minded __init__ not run
    torch.nn.Module.__init__(method)  # (a CustomOp is a module)
    method.moe_kernel = SimpleNamespace(fused_experts=object.__new__(experts_cls))
    method.moe_quant_config = "config"
    layer = torch.nn.Module()
    layer.quant_method = method
    return layer


def _model():
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts

    model = torch.nn.Module()
    model.cpu_experts, model.triton_experts, model.dense = _layer(CPUUnquantizedExperts), _layer(TritonExperts), \
        torch.nn.Linear(2, 2)
    return model


def test_moe_reload_sets_up_again_only_the_layers_whose_post_load_vllm_skips():
    from megatron_refit.engines.vllm.worker.moe_reload import FirstLoadSetup, check_reloadable

    model = _model()
    cpu, triton = model.cpu_experts.quant_method, model.triton_experts.quant_method
    kernels = cpu.moe_kernel, triton.moe_kernel
    assert check_reloadable(model) == 1
    with FirstLoadSetup(model) as setup:
        assert setup.layers == 1 and cpu.moe_kernel is None and triton.moe_kernel is kernels[1]
    assert cpu.moe_kernel is kernels[0] and cpu.moe_quant_config == "config"  # not processed: its own back
    with FirstLoadSetup(model):
        cpu.moe_kernel = "rebuilt by vLLM's first-load path"  # what process_weights_after_loading does
    assert cpu.moe_kernel == "rebuilt by vLLM's first-load path"


def test_moe_reload_refuses_an_unquantized_method_it_cannot_set_up_again():
    from megatron_refit.engines.vllm.worker.moe_reload import check_reloadable

    model = _model()
    del model.cpu_experts.quant_method.moe_kernel
    with pytest.raises(ValueError, match=r"vLLM layer cpu_experts: its UnquantizedFusedMoEMethod has no moe_kernel"):
        check_reloadable(model)
