"""Trainer-side FP8 into SGLang 0.5.23's real block-FP8 parameters (CPU, gloo).

Two train ranks hold dim-0 halves of tiny 128-aligned models, quantize them to 128×128 FP8
blocks (``quantize_pieces``) and refit one SGLang engine of two TP ranks built from an FP8
checkpoint config (``quant_method: fp8``, ``weight_block_size: [128, 128]``,
:mod:`.sglang_fp8`): ``weight`` float8_e4m3fn and ``weight_scale_inv`` go straight into
SGLang's fused ``qkv_proj`` / ``gate_up_proj`` / ``w13_weight`` / ``w2_weight`` and their
scale tiles (SGLang names them as vLLM does), with no re-quantization. Reference: SGLang's
own ``load_weights`` fed the FP8 checkpoint made by quantizing the full tensors, on a second
model instance on the same rank; both start NaN-filled, so every element must be written.

SGLang's Qwen3-MoE makes every layer sparse (``sglang/srt/models/qwen3_moe.py`` 873-878,
``stage_facts``: ``is_layer_sparse = True``; ``mlp_only_layers`` is not read), so the dense
``gate_up_proj`` scale layout comes from a dense Qwen3 refit in the same spawn. Its router
(``mlp.gate``) is built unquantized whatever the checkpoint says (``qwen3_moe.py`` 285-296:
``quant_config`` only for modelslim); the config lists it in ``modules_to_not_convert`` too.

The models are built by SGLang's dummy loader with its post-load, which on this host keeps
the checkpoint layout (see :mod:`.sglang_fp8`: SGLang's CPU-engine FP8 post-load needs AMX
and ``sgl_kernel``, and is not what runs here). Only loading is exercised, never a matmul.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from megatron_refit.endpoint.fp8 import fp8_checkpoint
from megatron_refit.local.launch import free_ports, run_spawned

# find_spec, not importorskip: the spawned ranks import this module too, and the train
# ranks do not need SGLang's imports
if importlib.util.find_spec("sglang") is None:
    pytest.skip("needs SGLang (make setup-sglang: .venv-sglang)", allow_module_level=True)

NUM_TRAIN = 2
GEN_TP = 2
VERSIONS = {1: 11, 2: 22}
"""Refit version -> the seed of the trainer's weights."""
ALIGNED = dict(hidden=256, heads=4, kv_heads=2, head_dim=128, ffn=256)
"""Every quantized dim a multiple of 128 per train and generation rank (q 512, k/v 256,
MLP and expert intermediate 256: 128 rows per rank at TP2)."""
MODELS = ["qwen3-moe", "qwen3"]
"""Qwen3-MoE: ``qkv_proj``, FusedMoE ``w13`` / ``w2`` and a bf16 router; Qwen3: ``gate_up_proj``."""
BUCKET_BYTES = 256 << 10


def _bf16_tensors(model_name: str, seed: int) -> tuple[dict, object]:
    """The trainer's full weights under checkpoint names, bfloat16 (HF's init, seeded)."""
    from transformers import AutoModelForCausalLM

    from conversion.presets import hf_config
    from megatron_refit.engines.hf.storage import HFStorage

    cfg = hf_config(model_name, **ALIGNED)
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return {n: t.bfloat16() for n, t in HFStorage(hf).state_dict_hf().items()}, cfg


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.data.contiguous().reshape(-1).view(torch.uint8)


def _train(rank, world, refit_ports):
    from megatron_refit.config import RefitConfig
    from megatron_refit.endpoint.sender import TensorPiece
    from megatron_refit.plan.spec import ShardSpec, box_along, full_box
    from megatron_refit.refit import trainer_refit_from_pieces

    out = {}
    for model_name, port in zip(MODELS, refit_ports):
        fleet, pieces, reports = None, {}, []
        for version, seed in VERSIONS.items():
            full, _ = _bf16_tensors(model_name, seed)
            for name, t in full.items():
                shape = tuple(t.shape)
                box = full_box(shape)
                if t.ndim >= 2 and shape[0] % (128 * NUM_TRAIN) == 0:  # dim-0 halves on 128-row block edges
                    n = shape[0] // NUM_TRAIN
                    box = box_along(shape, 0, rank * n, (rank + 1) * n)
                data = t[tuple(slice(a, b) for a, b in box)]
                if name in pieces:  # the next step's weights, in place of the old (the plan stays)
                    pieces[name].data = data
                else:
                    spec = ShardSpec(name=name, global_shape=shape, dtype="bfloat16", box=box)
                    pieces[name] = TensorPiece(spec, data)
            if fleet is None:  # quantized on the trainer (refit.trainer_quantize_fp8), as the engine's hook expects
                cfg = RefitConfig(enabled=True, engine="sglang", gen_tp=GEN_TP, port=port, timeout_s=120,
                                  bucket_mb=BUCKET_BYTES / (1 << 20), trainer_quantize_fp8=True)
                fleet = trainer_refit_from_pieces(cfg, list(pieces.values()), [], rank=rank, num_train=NUM_TRAIN)
            reports.append(fleet.refit(version).as_dict())
        fleet.close()
        out[model_name] = reports
    return out


def _gen(rank, world, sglang_port, refit_ports, workdir):
    from conversion.presets import hf_config
    from megatron_refit.engines.sglang.worker.loader import engine_refit_for

    from .sglang_cpu import init_sglang
    from .sglang_fp8 import build_fp8_model, write_fp8_model_dir

    gen_index = rank - NUM_TRAIN  # one engine: its TP rank
    dirs = {m: write_fp8_model_dir(hf_config(m, **ALIGNED), os.path.join(workdir, f"{m}.tp{gen_index}"))
            for m in MODELS}
    init_sglang(GEN_TP, gen_index, sglang_port, dirs[MODELS[0]])
    out = {}
    for model_name, port in zip(MODELS, refit_ports):
        model, reference = build_fp8_model(dirs[model_name]), build_fp8_model(dirs[model_name])
        with torch.no_grad():  # SGLang's dummy init is seeded: both would start equal. Every
            for param in (*model.parameters(), *reference.parameters()):  # element unwritten stays NaN
                param.fill_(float("nan"))
        # the shipped hook's connect: the plan from SGLang's own config, FP8 tables for the
        # trainer-side quantization (refit.trainer_quantize_fp8)
        member = engine_refit_for(model, dict(gen_tp=GEN_TP, port=port, bucket_mb=BUCKET_BYTES / (1 << 20),
                                            timeout_s=120, trainer_quantize_fp8=True), num_train=NUM_TRAIN)
        backend, receiver = member.full.storage, member
        checks = []
        for version, seed in VERSIONS.items():
            report = receiver.receive(version)
            full, _ = _bf16_tensors(model_name, seed)
            reference.load_weights(iter(fp8_checkpoint(full).items()))
            mine, theirs = dict(model.named_parameters()), dict(reference.named_parameters())
            checks.append(dict(
                report=report.as_dict(), names_equal=set(mine) == set(theirs),
                diff=sorted(n for n in mine if n in theirs and not torch.equal(_bytes(mine[n]), _bytes(theirs[n]))),
                dtypes={n: str(p.dtype).removeprefix("torch.") for n, p in mine.items()},
                received=sorted({spec.name for spec in backend.target_specs()}),
                nan=sorted(n for n, p in mine.items() if p.detach().float().isnan().any()),
            ))
        out[model_name] = checks
    return out


def _rank(rank, world, port, sglang_port, refit_ports, workdir):
    if rank < NUM_TRAIN:
        return _train(rank, world, refit_ports)
    return _gen(rank, world, sglang_port, refit_ports, workdir)


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """Every rank's results (train ranks first): 2 train ranks, one SGLang engine at TP2."""
    sglang_port, *refit_ports = free_ports(1 + len(MODELS))
    return run_spawned(_rank, NUM_TRAIN + GEN_TP, sglang_port, refit_ports,
                       str(tmp_path_factory.mktemp("sglang-fp8")), timeout_s=300)


def _ends(names, suffix: str) -> list[str]:
    return [n for n in names if n.endswith(suffix)]


def _dtypes(dtypes: dict[str, str], suffix: str) -> set[str]:
    """The dtypes of the engine parameters named ``*suffix`` (refusing when there are none)."""
    names = _ends(dtypes, suffix)
    assert names, f"no engine parameter *{suffix}"
    return {dtypes[n] for n in names}


@pytest.mark.slow
@pytest.mark.parametrize("model_name", MODELS)
def test_fp8_refit_matches_sglang_fp8_checkpoint_load(model_name, spawned):
    for train_reports in zip(*(r[model_name] for r in spawned[:NUM_TRAIN])):
        assert sum(r["bytes_sent"] for r in train_reports) == train_reports[0]["bytes_minimal"] > 0
    for gen in spawned[NUM_TRAIN:]:
        for check in gen[model_name]:
            assert check["names_equal"]
            assert check["diff"] == [], check["diff"][:5]  # every parameter bit-exact, scale tiles included
            assert check["nan"] == [], check["nan"][:5]  # ...and every element written (all started NaN)
            assert check["report"]["bytes_received"] > 0
            dtypes, received = check["dtypes"], check["received"]
            # block-quantized in SGLang's fused parameters, received as FP8 data + tiles
            assert _dtypes(dtypes, "qkv_proj.weight") == _dtypes(dtypes, "o_proj.weight") == {"float8_e4m3fn"}
            assert _dtypes(dtypes, "weight_scale_inv") == {"float32"}
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                assert _ends(received, f"self_attn.{proj}.weight_scale_inv")
            if model_name == "qwen3-moe":
                assert _dtypes(dtypes, "experts.w13_weight") == _dtypes(dtypes, "experts.w2_weight") == {
                    "float8_e4m3fn"}
                assert _ends(dtypes, "experts.w13_weight_scale_inv") and _ends(dtypes, "experts.w2_weight_scale_inv")
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    assert _ends(received, f"{proj}.weight_scale_inv") and all(
                        ".mlp.experts." in n for n in _ends(received, f"{proj}.weight_scale_inv"))
                assert _dtypes(dtypes, "mlp.gate.weight") == {"bfloat16"}  # the router stays bf16...
                assert _ends(received, "mlp.gate.weight") and not _ends(received, "mlp.gate.weight_scale_inv")
            else:
                assert _dtypes(dtypes, "mlp.gate_up_proj.weight") == {"float8_e4m3fn"}
                assert _ends(dtypes, "mlp.gate_up_proj.weight_scale_inv")
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    assert _ends(received, f"mlp.{proj}.weight_scale_inv")
