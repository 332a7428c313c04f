"""Trainer-side FP8 into vLLM's real block-quantized parameters (CPU, gloo).

Two train ranks hold dim-0 halves of a tiny 128-aligned model, quantize them to 128×128
FP8 blocks (``quantize_pieces``) and refit vLLM ranks built from an FP8 checkpoint config
(``quant_method: fp8``, ``weight_block_size: [128, 128]``): ``weight`` float8_e4m3fn and
``weight_scale_inv`` go straight into vLLM's fused ``qkv_proj`` / ``gate_up_proj`` /
``w13`` / ``w2`` parameters and their scale tiles, with no re-quantization. Reference:
vLLM's own ``load_weights`` fed the FP8 checkpoint made by quantizing the full tensors.

On CPU vLLM's block-FP8 linear kernel demands AMX (its ``is_supported`` is bypassed: only
loading is exercised, never the matmul) and ``process_weights_after_loading`` needs vLLM's
C++ ops: post-load runs on a GPU only.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from megatron_refit.endpoint.fp8 import fp8_checkpoint
from megatron_refit.local.launch import free_ports, run_spawned

pytest.importorskip("vllm")


def _full_tensors(model_name: str, seed: int, **overrides) -> tuple[dict, object]:
    from transformers import AutoModelForCausalLM

    from conversion.presets import hf_config
    from megatron_refit.engines.hf.storage import HFStorage

    cfg = hf_config(model_name, **overrides)
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return HFStorage(hf).state_dict_hf(), cfg


def _vllm_model(cfg, tp: int, rank: int, port: int, workdir: str, quant: dict | None = None,
                dtype: str = "float32"):
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader import get_model_loader  # noqa: F401  (registers loaders)
    from vllm.model_executor.models import ModelRegistry

    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump(dict(cfg.to_dict(), **({"quantization_config": quant} if quant else {})), f)
    vcfg = VllmConfig(
        model_config=ModelConfig(workdir, skip_tokenizer_init=True, enforce_eager=True, max_model_len=128,
                                 dtype=dtype),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        device_config=DeviceConfig("cpu"),
        load_config=LoadConfig(load_format="dummy"),
    )
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if not model_parallel_is_initialized():  # once per process: several models share the TP group
        with set_current_vllm_config(vcfg):
            init_distributed_environment(world_size=tp, rank=rank, local_rank=rank, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{port}")
            initialize_model_parallel(tp, 1, backend="gloo")
    model_cls, _ = ModelRegistry.resolve_model_cls(cfg.architectures, vcfg.model_config)

    def build():
        # attention layers register by name; a second instance (the reference) needs a clean slate
        vcfg.compilation_config.static_forward_context.clear()
        from vllm.utils.torch_utils import set_default_torch_dtype

        with set_current_vllm_config(vcfg), set_default_torch_dtype(vcfg.model_config.dtype), torch.device("cpu"):
            return model_cls(vllm_config=vcfg).eval()

    return vcfg, build


def _under(vcfg, fn):
    """``fn`` run inside vLLM's current-config context (its layers look it up)."""
    from vllm.config import set_current_vllm_config

    def run():
        with set_current_vllm_config(vcfg):
            return fn()

    return run


ALIGNED = dict(hidden=256, heads=4, kv_heads=2, head_dim=128, ffn=256)
# One spawn covers every fused scale layout: layer 0 is a dense MLP (gate_up_proj), layer 1
# MoE (w13 / w2); both have qkv_proj. (Each vLLM rank costs ~30 s of imports.)
CASES = [("qwen3-moe", 2)]
MIXED = dict(mlp_only_layers=[0], intermediate_size=256)


def _bf16_tensors(model_name: str, seed: int):
    full, cfg = _full_tensors(model_name, seed, **ALIGNED, **MIXED)
    return {n: t.bfloat16() for n, t in full.items()}, cfg


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.data.contiguous().reshape(-1).view(torch.uint8)


def _quant_config(cfg) -> dict:
    routers = [f"model.layers.{i}.mlp.gate" for i in range(cfg.num_hidden_layers)]
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
            "modules_to_not_convert": routers if getattr(cfg, "num_experts", 0) else []}


def _rank(rank, world, port, model_name, gen_tp, vllm_port, workdir):
    from megatron_refit.endpoint.receiver import Receiver
    from megatron_refit.endpoint.sender import Refitter, TensorPiece
    from megatron_refit.plan.fp8_layout import fp8_param_table
    from megatron_refit.endpoint.fp8_pieces import quantize_pieces
    from megatron_refit.plan.gen_layout import GenLayout
    from megatron_refit.engines.hf.checkpoint import model_shape
    from megatron_refit.engines.fused.live import LiveModelStorage
    from megatron_refit.plan.spec import ShardSpec, box_along, full_box
    from megatron_refit.transport import ProcessGroupTransport

    num_train = 2
    # the train ranks' prepare waits for the gen ranks to build vLLM's model (gen TP2: ~100 s on 2 busy cores)
    group = ProcessGroupTransport.connect(host="127.0.0.1", port=port, rank=rank, world_size=world, timeout_s=300)
    versions = {1: 11, 2: 22}
    if rank < num_train:
        out = []
        for version, seed in versions.items():
            full, _ = _bf16_tensors(model_name, seed)
            pieces = []
            for name, t in full.items():
                shape = tuple(t.shape)
                box = full_box(shape)
                if t.ndim >= 2 and shape[0] % (128 * num_train) == 0:
                    n = shape[0] // num_train
                    box = box_along(shape, 0, rank * n, (rank + 1) * n)
                spec = ShardSpec(name=name, global_shape=shape, dtype="bfloat16", box=box)
                pieces.append(TensorPiece(spec, t[tuple(slice(a, b) for a, b in box)]))
            pieces = quantize_pieces(pieces)
            if version == 1:
                refitter = Refitter(group, pieces, num_train=num_train, num_gen=gen_tp, bucket_bytes=256 << 10)
                refitter.prepare()
            else:
                refitter.pieces = {p.spec.name: p for p in pieces}
            out.append(refitter.refit(version).as_dict())
        return out

    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUFp8BlockScaledMMKernel

    # loading only: the CPU block-FP8 matmul needs AMX, which these CPUs lack
    CPUFp8BlockScaledMMKernel.is_supported = classmethod(lambda cls, compute_capability=None: (True, None))
    gen_index = rank - num_train
    full, cfg = _bf16_tensors(model_name, versions[1])
    vcfg, build = _vllm_model(cfg, gen_tp, gen_index, vllm_port, workdir, quant=_quant_config(cfg),
                               dtype="bfloat16")
    model = build()
    params = fp8_param_table({n: (tuple(t.shape), "bfloat16") for n, t in full.items()})
    backend = LiveModelStorage.for_model(model, params, GenLayout(tp=gen_tp), model_shape(cfg), gen_index=gen_index)
    receiver = Receiver(group, backend, num_train=num_train, num_gen=gen_tp, bucket_bytes=256 << 10)
    receiver.prepare()
    results = []
    for version, seed in versions.items():
        report = receiver.receive(version)
        full, _ = _bf16_tensors(model_name, seed)
        ref = build()
        _under(vcfg, lambda: ref.load_weights(iter(fp8_checkpoint(full).items())))()
        mine, theirs = dict(model.named_parameters()), dict(ref.named_parameters())
        assert set(mine) == set(theirs)
        diff = [n for n in mine if not torch.equal(_bytes(mine[n]), _bytes(theirs[n]))]
        fp8 = sorted(n for n, p in mine.items() if p.dtype == torch.float8_e4m3fn)
        scales = sorted(n for n in mine if n.endswith("scale_inv"))
        results.append(dict(report=report.as_dict(), diff=diff, fp8=fp8, scales=scales,
                            shapes={n: tuple(p.shape) for n, p in mine.items()}))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("model_name,gen_tp", CASES, ids=[f"{m}-genTP{t}" for m, t in CASES])
def test_fp8_refit_matches_vllm_fp8_checkpoint_load(model_name, gen_tp, tmp_path):
    vllm_port, refit_port = free_ports(2)
    out = run_spawned(_rank, 2 + gen_tp, model_name, gen_tp, vllm_port, str(tmp_path), timeout_s=400,
                      env={"VLLM_TARGET_DEVICE": "cpu"}, port=refit_port)
    for gen in out[2:]:
        for item in gen:
            assert item["diff"] == [], item["diff"][:5]
            assert any(n.endswith("qkv_proj.weight") for n in item["fp8"])  # block-quantized params...
            assert any(n.endswith("qkv_proj.weight_scale_inv") for n in item["scales"])  # ...with their tiles
            assert any(n.endswith("gate_up_proj.weight_scale_inv") for n in item["scales"])
            if "moe" in model_name:
                assert any(n.endswith("w13_weight") for n in item["fp8"])
                assert any(n.endswith("w2_weight_scale_inv") for n in item["scales"])
                assert not any(n.endswith("mlp.gate.weight") for n in item["fp8"])  # the router stays bf16
    for train_reports in zip(*out[:2]):
        assert sum(r["bytes_sent"] for r in train_reports) == train_reports[0]["bytes_minimal"]
