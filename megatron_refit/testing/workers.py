"""Rank functions run in spawned processes by the multi-process tests (must be importable)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

COLLECTIVES = (
    "all_gather", "all_gather_object", "all_gather_into_tensor", "all_reduce", "broadcast",
    "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter",
    "gather", "gather_object", "barrier", "send", "recv", "isend", "irecv", "all_to_all",
    "all_to_all_single", "batch_isend_irecv",
)


class CollectiveCalledError(RuntimeError):
    pass


@contextlib.contextmanager
def forbid_collectives():
    """Make every torch.distributed collective / P2P call raise while active."""
    saved = {}

    def refuse(name):
        def _raise(*args, **kwargs):
            raise CollectiveCalledError(f"torch.distributed.{name} called during enumeration")
        return _raise

    modules = (dist, dist.distributed_c10d)
    for mod in modules:
        for name in COLLECTIVES:
            if hasattr(mod, name):
                saved[(mod, name)] = getattr(mod, name)
                setattr(mod, name, refuse(name))
    try:
        yield
    finally:
        for (mod, name), fn in saved.items():
            setattr(mod, name, fn)


def layout_from(kw):
    from megatron_refit.plan.layout import TrainLayout

    return TrainLayout(**kw)


def enumerate_cases(rank, world_size, port, cases):
    """For each (model, layout kwargs, pad_vocab) case: this rank's real shards (cloned),
    its meta-device specs, and (rank 0) Bridge's full export. Layouts are re-initialised
    in the same processes, so one spawn covers several layouts."""
    from conversion.testing.build import build_model, destroy_model_parallel, init_gloo, init_model_parallel
    from conversion.local_shards import enumerate_local_shards, group_experts
    from conversion.presets import hf_config, num_routed_experts

    init_gloo(rank, world_size, port)
    results = []
    for model_name, layout_kw, pad_vocab in cases:
        layout = layout_from(layout_kw)
        init_model_parallel(layout)
        cfg = hf_config(model_name)
        built = build_model(cfg, layout, pad_vocab=pad_vocab)
        randomize_replicated_(built.model)
        with forbid_collectives():
            shards = enumerate_local_shards(built.bridge, built.model, cfg)
            grouped = group_experts(shards, num_routed_experts(cfg))
        real = [(s.spec, s.tensor().detach().clone()) for s in shards]
        grouped = [(s.spec, s.tensor().detach().clone()) for s in grouped]
        views = [_is_view_of_param(s, built.model) for s in shards]
        export = {
            name: t.detach().clone()
            for name, t in built.bridge.export_hf_weights(built.model, cpu=True, show_progress=False)
        }
        meta_built = build_model(cfg, layout, meta=True, pad_vocab=pad_vocab)
        with forbid_collectives():
            meta_shards = enumerate_local_shards(meta_built.bridge, meta_built.model, cfg)
        meta_devices = {s.tensor().device.type for s in meta_shards}
        results.append(
            dict(
                real=real,
                grouped=grouped,
                views=views,
                meta=[s.spec for s in meta_shards],
                meta_devices=meta_devices,
                export=export if rank == 0 else None,
            )
        )
        destroy_model_parallel()
    dist.destroy_process_group()
    return results


def randomize_replicated_(model) -> None:
    """Give TP-replicated params (norms, router: initialised to constants or identical
    draws) and router expert-bias buffers distinct values, seeded by their global name so
    every replica agrees."""
    import zlib

    from megatron.bridge.models.conversion.model_bridge import _megatron_local_name_to_global

    config = model[0].config
    for vp, chunk in enumerate(model):
        for name, p in chunk.named_parameters():
            if getattr(p, "tensor_model_parallel", False):
                continue
            gname = _megatron_local_name_to_global(model, config, name.removeprefix("module."), vp)
            g = torch.Generator().manual_seed(zlib.crc32(gname.encode()))
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
        for name, b in chunk.named_buffers():
            if name.endswith("router.expert_bias"):  # DeepSeek's e_score_correction_bias (zeros at init)
                gname = _megatron_local_name_to_global(model, config, name.removeprefix("module."), vp)
                b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(zlib.crc32(gname.encode()))))


def _is_view_of_param(shard, model) -> bool:
    """Whether the shard's tensor shares storage with a model parameter (no copy)."""
    ptrs = {p.untyped_storage().data_ptr() for chunk in model for p in chunk.parameters()}
    return shard.tensor().untyped_storage().data_ptr() in ptrs


SCALE_BLOCK = 16  # tiny models: 16x16 tiles stand in for FP8's 128x128 (mapping-level check)


def _tile_amax(w: torch.Tensor, block: int) -> torch.Tensor:
    rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
    padded = torch.zeros(rows * block, cols * block, dtype=torch.float32)
    padded[: w.shape[0], : w.shape[1]] = w.detach().float().abs()
    return padded.view(rows, block, cols, block).amax(dim=(1, 3))


def scale_inv_cases(rank, world_size, port, cases):
    """Mapping-level FP8 check: build Bridge ``_HFNameSuffixMapping`` ``*_scale_inv``
    sibling tasks (as ``build_export_fp8_tasks`` does) whose tensors are per-tile scales of
    the local weights, then compare our local scale pieces with Bridge's own gathered
    ``megatron_to_hf`` of those tasks."""
    from conversion.testing.build import build_model, destroy_model_parallel, init_gloo, init_model_parallel
    from conversion.presets import hf_config
    from conversion.local_shards import task_shards  # imports megatron.bridge through the TE shim
    from conversion.bridge_api import SuffixMapping, model_bridge_of
    from megatron.bridge.models.conversion.model_bridge import WeightConversionTask

    init_gloo(rank, world_size, port)
    results = []
    for model_name, layout_kw in cases:
        layout = layout_from(layout_kw)
        init_model_parallel(layout)
        cfg = hf_config(model_name)
        built = build_model(cfg, layout)
        model_bridge = model_bridge_of(built.bridge)
        registry = model_bridge.mapping_registry()
        tasks = model_bridge.build_conversion_tasks(cfg, built.model)
        scale_tasks = []
        for t in tasks:
            w = t.param_weight
            if w is None or w.ndim != 2 or "embed" in t.global_param_name or "output_layer" in t.global_param_name \
                    or "router" in t.global_param_name:
                continue
            scale_tasks.append(WeightConversionTask(
                pp_rank=t.pp_rank, vp_stage=t.vp_stage, param_name=t.param_name + "_scale_inv",
                global_param_name=t.global_param_name + "_scale_inv", megatron_module=t.megatron_module,
                param_weight=_tile_amax(w, SCALE_BLOCK),
                mapping=SuffixMapping(registry.resolve_mapping(t.mapping, ()), "_scale_inv"),
            ))
        with forbid_collectives():
            ours = [(s.spec, s.tensor().clone())
                    for t in scale_tasks for s in task_shards(t, vocab_size=cfg.vocab_size)]
        bridge = {n: v.clone() for n, v in model_bridge.stream_weights_megatron_to_hf(
            built.model, cfg, cpu=True, show_progress=False, conversion_tasks=scale_tasks)}
        results.append(dict(ours=ours, bridge=bridge if rank == 0 else None))
        destroy_model_parallel()
    dist.destroy_process_group()
    return results


FP8_ALIGNED = dict(hidden=256, heads=4, kv_heads=2, head_dim=128, ffn=256)
TE_LINEAR = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")


def te_stand_in(weight: torch.Tensor):
    """A CPU stand-in with TE's ``get_metadata()`` of a Float8Blockwise weight (TE needs CUDA
    to create real ones): the local weight quantized in 128x128 blocks with power-of-two
    scales, scale columns zero-padded to a multiple of 4 as TE stores them."""
    from megatron_refit.endpoint.fp8 import quantize_blockwise

    q, scale_inv = quantize_blockwise(weight.detach().float(), pow2_scales=True)
    padded = torch.zeros(scale_inv.shape[0], -(-scale_inv.shape[1] // 4) * 4)
    padded[:, : scale_inv.shape[1]] = scale_inv
    quantizer = type("Float8BlockQuantizer", (), {"block_len": 128})()
    meta = dict(rowwise_data=q.view(torch.uint8), rowwise_scale_inv=padded, quantizer=quantizer, is_2D_scaled=True)
    return type("Float8BlockwiseQTensor", (), {"shape": weight.shape, "ndim": weight.ndim,
                                               "get_metadata": lambda self: meta})()


def te_fp8_cases(rank, world_size, port, cases):
    """TE pass-through at mapping level: Megatron linear weights replaced by Float8Blockwise
    stand-ins; our local data + scale pieces vs Bridge's gathered export of the same tasks
    (data as uint8 for gloo), plus Bridge's ordinary full export for the parent's check."""
    import dataclasses

    from conversion.testing.build import build_model, destroy_model_parallel, init_gloo, init_model_parallel
    from conversion.presets import hf_config
    from conversion.local_shards import enumerate_local_shards, local_conversion_tasks
    from conversion.bridge_api import model_bridge_of
    from conversion.te_fp8 import check_fp8_specs, pass_through_tasks

    init_gloo(rank, world_size, port)
    results = []
    for model_name, layout_kw in cases:
        init_model_parallel(layout_from(layout_kw))
        cfg = hf_config(model_name, **FP8_ALIGNED)
        built = build_model(cfg, layout_from(layout_kw))
        model_bridge = model_bridge_of(built.bridge)
        tasks = [dataclasses.replace(t, param_weight=te_stand_in(t.param_weight))
                 if t.global_param_name.endswith(TE_LINEAR) and ".router." not in t.global_param_name else t
                 for t in local_conversion_tasks(built.bridge, built.model, cfg)]
        passed = pass_through_tasks(model_bridge, tasks)
        with forbid_collectives():
            shards = enumerate_local_shards(built.bridge, built.model, cfg, tasks=passed)
            check_fp8_specs([s.spec for s in shards])
            ours = [(s.spec, s.tensor().contiguous().clone()) for s in shards]
        as_bytes = [dataclasses.replace(t, param_weight=t.param_weight.view(torch.uint8))
                    if t.param_weight.dtype == torch.float8_e4m3fn else t for t in passed]
        bridge = {n: v.clone() for n, v in model_bridge.stream_weights_megatron_to_hf(
            built.model, cfg, cpu=True, show_progress=False, conversion_tasks=as_bytes)}
        export = {n: v.clone() for n, v in built.bridge.export_hf_weights(built.model, cpu=True, show_progress=False)}
        results.append(dict(ours=ours, bridge=bridge if rank == 0 else None, export=export if rank == 0 else None))
        destroy_model_parallel()
    dist.destroy_process_group()
    return results


def lora_cases(rank, world_size, port, cases):
    """LoRA adapters: our local adapter pieces vs Bridge's gathered adapter export, and the
    base pieces of the wrapped model vs Bridge's export of the model before wrapping."""
    from conversion.testing.build import build_model, destroy_model_parallel, init_gloo, init_model_parallel
    from conversion.presets import hf_config
    from conversion.local_shards import enumerate_local_shards
    from conversion.lora import adapter_shards, apply_lora

    init_gloo(rank, world_size, port)
    results = []
    for model_name, layout_kw in cases:
        init_model_parallel(layout_from(layout_kw))
        cfg = hf_config(model_name)
        built = build_model(cfg, layout_from(layout_kw))
        # LoRA freezes the base: its weights are those exported before wrapping
        export = {n: v.clone() for n, v in built.bridge.export_hf_weights(built.model, cpu=True, show_progress=False)}
        model = apply_lora(built.model, dim=4, alpha=8)
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for name, p in model[0].named_parameters():
                if "linear_out" in name or "linear_in" in name:
                    p.copy_(torch.randn(p.shape, generator=g))
        with forbid_collectives():
            ours = [(s.spec, s.tensor().contiguous().clone()) for s in adapter_shards(built.bridge, model, cfg)]
            base = [(s.spec, s.tensor().contiguous().clone()) for s in enumerate_local_shards(built.bridge, model, cfg)]
        adapters = {n: v.clone() for n, v in built.bridge.export_adapter_weights(model, cpu=True, show_progress=False)}
        results.append(dict(ours=ours, base=base, adapters=adapters if rank == 0 else None,
                            export=export if rank == 0 else None))
        destroy_model_parallel()
    dist.destroy_process_group()
    return results
