"""vLLM 0.33 on CPU with non-gated (ReLU², Nemotron-H) MoE layers: the two places vLLM refuses.

``FusedMoEConfig.__post_init__`` refuses ``is_act_and_mul=False`` unless the platform is
CUDA / ROCm / XPU (its only platform question), and no CPU MoE kernel takes a non-gated
activation, so backend selection raises. For tests that check weights (not MoE kernels)
on CPU: answer the platform question inside ``__post_init__`` only, and for non-gated MoE
only fall back to what an H100 picks (TRITON / ``TritonExperts``: experts stored unpadded,
post-load copies them back in place).
"""

from __future__ import annotations

from unittest import mock


def allow_non_gated_moe_on_cpu() -> None:
    from vllm.model_executor.layers.fused_moe import config as moe_config
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as methods
    from vllm.model_executor.layers.fused_moe.oracle import unquantized as oracle

    config_cls = moe_config.FusedMoEConfig
    if getattr(config_cls.__post_init__, "_cpu_non_gated", False):
        return
    post_init, select = config_cls.__post_init__, methods.select_unquantized_moe_backend

    def checked_as_on_a_gpu(self):
        with mock.patch.object(moe_config.current_platform, "is_xpu", lambda: True):
            post_init(self)

    def select_backend(moe_config):
        try:
            return select(moe_config=moe_config)
        except NotImplementedError:
            if moe_config.is_act_and_mul:
                raise
            from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts

            return oracle.UnquantizedMoeBackend.TRITON, TritonExperts

    checked_as_on_a_gpu._cpu_non_gated = True
    config_cls.__post_init__ = checked_as_on_a_gpu
    methods.select_unquantized_moe_backend = select_backend
