"""DeepSeek-V3 on CPU: Megatron's per-layer block spec (dense first layers, MLA, MoE with
shared experts) without TE, with a core attention that accepts MLA's different query/key and
value head dims (the local ``DotProductAttention`` rejects ``k_channels``), and its MTP layers
from the same local spec (Bridge builds them with TE's). :class:`~conversion.testing.core_attention.CPUCoreAttention`
holds no weights, so weights, conversion tasks and refit are exactly Bridge's. Named by the
family table (:mod:`megatron_refit.families.deepseek_v3`)."""

from __future__ import annotations

import contextlib

from conversion.testing.core_attention import CPUCoreAttention, with_core_attention


def configure_provider(provider, *, meta: bool) -> None:
    provider.transformer_layer_spec = mla_block_spec
    # The shared-expert overlap needs CUDA streams (make_provider turned the fusions off).
    provider.moe_shared_expert_overlap = False


def mla_block_spec(config, vp_stage=None):
    """Megatron's per-layer GPT block spec without TE, with :class:`CPUCoreAttention`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage)
    with_core_attention(block, CPUCoreAttention)
    return block


def mtp_block_spec(config, vp_stage=None):
    """Bridge's ``mtp_block_spec`` with the local spec: each MTP layer is the model's last
    decoder layer as :func:`mla_block_spec` builds it (MoE or dense), wrapped in Megatron's MTP
    layer of local modules (its ``eh_proj``, ``enorm``, ``hnorm``)."""
    if not getattr(config, "mtp_num_layers", None):
        return None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs, get_gpt_mtp_block_spec

    last = get_gpt_decoder_layer_specs(config, use_transformer_engine=False, normalization=config.normalization,
                                       qk_l2_norm=config.qk_l2_norm)[-1]
    with_core_attention(last, CPUCoreAttention)
    return get_gpt_mtp_block_spec(config, last, use_transformer_engine=False, vp_stage=vp_stage)


@contextlib.contextmanager
def build_context(meta: bool):
    """Bridge's provider builds MTP layers from TE's spec: the local one here (and the MoE
    router's buffers on the CPU, as every family's build)."""
    from megatron.bridge.models import gpt_provider

    from conversion.testing.families import cpu_device_for_buffers

    saved = gpt_provider.mtp_block_spec
    gpt_provider.mtp_block_spec = mtp_block_spec
    try:
        with cpu_device_for_buffers(meta):
            yield
    finally:
        gpt_provider.mtp_block_spec = saved
