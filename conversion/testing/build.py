"""Build a Megatron-Core model through Megatron-Bridge on CPU (gloo) or on the meta device.

Everything here is set up for CPU machines without Transformer Engine: the local (non-TE)
layer spec, gloo process groups initialised by us (Bridge would otherwise pick NCCL), CPU
initialisation, no mixed-precision wrapper, MoE's allgather dispatcher. Every parallel setting
of a :class:`TrainLayout` reaches Megatron as the recipes set it (sequence parallelism and
context parallelism through the weightless stand-ins of :mod:`conversion.testing.core_attention`).
"""

from __future__ import annotations

import contextlib
import io
import os
from dataclasses import dataclass
from typing import Any

import torch

from megatron_refit.plan.layout import TrainLayout

from conversion.forward import cpu_forward  # noqa: F401 -- the test builders' callers use it from here
from conversion.testing.families import build_context, configure_provider, family
from conversion.te_shim import import_bridge


@dataclass
class BuiltModel:
    """A Megatron model (one chunk per virtual pipeline stage) and the bridge that built it."""

    bridge: Any
    """megatron.bridge.AutoBridge for the HF config."""
    model: list
    """Megatron model chunks (a list, as Megatron-Bridge expects)."""
    hf_config: Any
    layout: TrainLayout

    @property
    def config(self):
        return self.model[0].config


def init_model_parallel(layout: TrainLayout, *, create_gloo_process_groups: bool = True) -> None:
    """``initialize_model_parallel`` for ``layout`` on the already-initialised default group."""
    from megatron.core import parallel_state

    world = torch.distributed.get_world_size()
    if world != layout.world_size:
        raise ValueError(
            f"world size {world} does not match layout {layout.describe()} "
            f"(needs tp*cp*dp*pp = {layout.world_size} ranks)"
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        create_gloo_process_groups=create_gloo_process_groups,
    )


def destroy_model_parallel() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def make_provider(hf_config, layout: TrainLayout, *, dtype: torch.dtype = torch.float32, pad_vocab: bool = False,
                  meta: bool = False):
    """Bridge's model provider for ``hf_config``, configured for ``layout`` on CPU.

    ``pad_vocab`` pads Megatron's vocab to a multiple of (divisor x TP), as Megatron
    training does; the HF names keep the unpadded vocab. ``meta``: for a meta-device build."""
    family(hf_config)  # ValueError for an architecture that cannot be built here
    import_bridge()
    from megatron.bridge import AutoBridge
    from megatron.bridge.models.gpt_provider import local_layer_spec

    bridge = AutoBridge.from_hf_config(hf_config)
    provider = bridge.to_megatron_provider(load_weights=False)
    provider.tensor_model_parallel_size = layout.tp
    provider.pipeline_model_parallel_size = layout.pp
    provider.expert_model_parallel_size = layout.ep
    provider.expert_tensor_parallel_size = layout.etp
    provider.virtual_pipeline_model_parallel_size = layout.vpp
    provider.context_parallel_size = layout.cp
    provider.num_layers_in_first_pipeline_stage = layout.first_stage_layers
    provider.num_layers_in_last_pipeline_stage = layout.last_stage_layers
    provider.account_for_embedding_in_pipeline_split = layout.account_for_embedding
    provider.account_for_loss_in_pipeline_split = layout.account_for_loss
    provider.pipeline_model_parallel_layout = None if layout.layout is None else [list(s) for s in layout.layout]
    provider.mtp_num_layers = layout.mtp_layers or None
    provider.sequence_parallel = layout.sequence_parallel
    provider.should_pad_vocab = pad_vocab
    provider.transformer_layer_spec = local_layer_spec
    provider.params_dtype = dtype
    provider.bf16 = dtype == torch.bfloat16
    provider.fp16 = False
    provider.autocast_dtype = dtype
    provider.pipeline_dtype = dtype
    provider.gradient_accumulation_fusion = False
    provider.persist_layer_norm = False
    provider.masked_softmax_fusion = False
    provider.bias_activation_fusion = False
    provider.bias_dropout_fusion = False
    provider.apply_rope_fusion = False
    provider.cross_entropy_loss_fusion = False
    provider.attention_backend = _local_attention_backend()
    if getattr(provider, "num_moe_experts", None):
        provider.moe_token_dispatcher_type = "allgather"
        provider.moe_permute_fusion = False
        provider.moe_grouped_gemm = False
        provider.moe_router_fusion = False
    configure_provider(provider, hf_config, meta=meta)
    if layout.cp > 1 and provider.transformer_layer_spec is local_layer_spec:
        provider.transformer_layer_spec = context_parallel_layer_spec  # TE's attention is Megatron's only CP one
    provider.finalize()
    return bridge, provider


def context_parallel_layer_spec(config, vp_stage=None):
    """Bridge's local layer spec with :class:`~conversion.testing.core_attention.CPUCoreAttention`
    (context-parallel) as its core attention, as the block spec of this stage (Bridge puts the
    local ``DotProductAttention`` back into a layer spec)."""
    from megatron.bridge.models.gpt_provider import local_layer_spec
    from megatron.core.transformer.transformer_block import _get_block_submodules

    from conversion.testing.core_attention import CPUCoreAttention, with_core_attention

    block = _get_block_submodules(config, local_layer_spec(config), vp_stage)
    with_core_attention(block, CPUCoreAttention)
    return block


def _local_attention_backend():
    from megatron.core.transformer.enums import AttnBackend

    return AttnBackend.local


def build_model(
    hf_config,
    layout: TrainLayout,
    *,
    meta: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 1234,
    pad_vocab: bool = False,
) -> BuiltModel:
    """Build this rank's Megatron model chunks. torch.distributed and model-parallel state
    must be initialised for ``layout`` (see :func:`init_model_parallel`)."""
    from conversion.validate import check_train_layout

    check_train_layout(hf_config, layout)
    bridge, provider = make_provider(hf_config, layout, dtype=dtype, pad_vocab=pad_vocab, meta=meta)
    torch.manual_seed(seed)
    # Megatron prints each rank's parameter count: dropped in a quiet spawned rank
    # (megatron_refit.local.launch sets REFIT_QUIET_LOGS=1 there)
    quiet = os.environ.get("REFIT_QUIET_LOGS") == "1"
    chatter = contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext()
    from conversion.cpu_shim import cuda_to_host
    from conversion.testing.core_attention import sequence_parallel_norms

    # a copy of the embedding on a later stage (tied output layer, MTP) is all-reduced with the
    # first stage's after ``.cuda()``: on a host it stays there
    host = cuda_to_host() if not torch.cuda.is_available() else contextlib.nullcontext()
    with build_context(hf_config, meta), sequence_parallel_norms(), host, chatter:
        model = provider.provide_distributed_model(
            wrap_with_ddp=False,
            use_cpu_initialization=True,
            init_model_with_meta_device=meta,
            mixed_precision_wrapper=None,
            bf16=dtype == torch.bfloat16,
            fp16=False,
        )
    if dtype != torch.float32:
        # What Megatron's Float16Module does (not used here: it assumes CUDA): every
        # parameter, norms included, in the training dtype.
        model = [chunk.to(dtype) for chunk in model]
        # ... except the router's expert bias (DeepSeek's e_score_correction_bias), which
        # Megatron's router keeps in float32 (it restores it on every forward).
        from conversion.bridge_api import keep_expert_bias_fp32

        for chunk in model:
            for module in chunk.modules():
                if getattr(module, "expert_bias", None) is not None:
                    keep_expert_bias_fp32(module)
    return BuiltModel(bridge=bridge, model=model, hf_config=hf_config, layout=layout)


def init_gloo(rank: int, world_size: int, port: int, timeout_s: float = 120.0) -> None:
    """Initialise the default process group on gloo over localhost."""
    import datetime

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    torch.distributed.init_process_group(
        "gloo",
        init_method=f"tcp://{os.environ['MASTER_ADDR']}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
