"""#67: trainer-side FP8 into SGLang 0.5.23's real FP8 NextN draft beside its FP8 main model, on CPU
over gloo: the draft takes the trainer's MTP layer as FP8 data and ``weight_scale_inv`` tiles
quantized by the main model's roles (its ``eh_proj`` stays bf16: a plain ``nn.Linear`` in SGLang's
NextN), in the same refit as the main model.

As test_mtp_draft_sglang.py (selector ``all``, SGLang's scheduler weight-update path with a target
and a draft worker), from Bridge's real local shards of a tiny DeepSeek-V3 with one MTP layer
trained in bf16 at TP2 x PP2 with sequence parallelism under the recipe's pipeline layout, every
shard of a quantized weight on the 128-element grid (``deepseek-v3-mtp-fp8``), quantized on the
train ranks (``refit.trainer_quantize_fp8``), into engine TP2 built from an FP8 checkpoint config
(:func:`.sglang_fp8.fp8_quant_config`: ``quant_method: fp8``, ``weight_block_size: [128, 128]``;
MLA's down projections not converted, the draft's under SGLang's ``model.decoder.`` spelling, as
trainer-side FP8 keeps them bf16). After each refit the main model must hold the bytes of SGLang's
own ``load_weights`` of Bridge's export quantized the same way (``fp8_checkpoint``) on a fresh FP8
model, the draft's own parameters those of a fresh FP8 NextN draft's ``load_weights`` of it, and
both the MLA absorb's ``w_kc`` / ``w_vc`` / ``w_scale`` that their ``post_load_weights`` derive
(on a host without CUDA SGLang requantizes the FP8 ``kv_b_proj`` per tensor there:
``block_quant_to_tensor_quant``, plain torch); the draft must have moved between the versions, the
bytes sent are the minimal ones and nothing is skipped. An engine whose FP8 config names the draft's
down projections by the checkpoint's names only (as vLLM takes them) holds them FP8 in SGLang's
draft: its refit is refused by name in the handshake.

Loading only, no matmul. SGLang's FP8 ``process_weights_after_loading`` runs on both sides (the
sessions' ``end_weight_update`` and the reference's load, :func:`_sglang_load`) and takes its
generic branch here, which keeps the checkpoint layout and bytes on a host without CUDA; the CPU
engine's branch, which repacks for AMX, needs AMX and ``sgl_kernel`` and is skipped on both sides
(:mod:`.sglang_fp8`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
import torch

from megatron_refit.local.launch import free_ports, run_spawned
from tests.engines.vllm.bridge_shards import make

if importlib.util.find_spec("sglang") is None:
    pytest.skip("needs SGLang (make setup-sglang: .venv-sglang)", allow_module_level=True)

from tests.engines.sglang.test_mtp_draft_sglang import (BRIDGE_SHARDS, FIRST_MTP, NUM_TRAIN, TP,  # noqa: E402
                                                        VERSIONS, _own, _refit_section, _sglang_config)

MODEL = "deepseek-v3-mtp-fp8"  # bridge_shards.py: deepseek-v3-mtp on the 128 grid, bf16
CASES = {"fp8": True, "draft-mla-down-fp8": False}
"""Case -> whether the FP8 config lists the draft's MLA down projections under SGLang's NextN
names (:func:`.sglang_fp8.fp8_quant_config`'s ``nextn_names``): without them SGLang builds the
draft's ``fused_qkv_a_proj_with_mqa`` in FP8, which the trainer sends bf16; refused by name."""
DERIVED = ("w_kc", "w_vc", "w_scale")
"""What SGLang's MLA post-load derives from an FP8 ``kv_b_proj`` on this host (per-tensor FP8 and its scale)."""


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` hold the same bytes (dtype, shape and every bit: FP8 and NaN included)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))


def _diff(mine: dict, theirs: dict) -> list[str]:
    return sorted(n for n in mine if n not in theirs or not _same(mine[n], theirs[n]))


def _derived(model) -> dict[str, torch.Tensor]:
    return {f"{name}.{attr}": getattr(module, attr) for name, module in model.named_modules()
            for attr in DERIVED if isinstance(getattr(module, attr, None), torch.Tensor)}


def _kv_scale(name: str) -> bool:
    """SGLang's FP8 KV-cache scales (``attn_mqa.k_scale``, ...): not in a checkpoint, never sent;
    SGLang's post-load sets them (1.0 where no checkpoint had them)."""
    return name.endswith((".k_scale", ".v_scale"))


def _nan_filled(*models) -> None:
    with torch.no_grad():  # every element a load leaves unwritten stays NaN (FP8 has one too)
        for model in models:
            for name, param in model.named_parameters():
                if not _kv_scale(name):  # SGLang's post-load refuses a NaN one
                    param.fill_(float("nan"))


def _sglang_load(model, checkpoint: dict) -> None:
    """SGLang's own load of ``checkpoint`` into ``model``, as its loader does it: ``load_weights``
    (DeepSeek's ends with its ``post_load_weights``, the MLA absorb), then every quant method's
    ``process_weights_after_loading`` (``postprocess_weights``, which SGLang's weight-update sessions
    run too when they end)."""
    from sglang.srt.model_loader.loader import DefaultModelLoader

    model.load_weights(iter(checkpoint.items()))
    DefaultModelLoader.postprocess_weights(model, torch.device("cpu"))


def _write_model_dir(workdir: str, nextn_names: bool) -> str:
    from bridge_shards import model_config

    from .sglang_fp8 import fp8_quant_config

    os.makedirs(workdir, exist_ok=True)
    hf_config = _sglang_config(model_config(MODEL))
    quant = fp8_quant_config(hf_config, nextn_names=nextn_names)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump(dict(hf_config.to_dict(), quantization_config=quant), f)
    return workdir


def _refit(port: int) -> dict:
    return dict(_refit_section(port, True), trainer_quantize_fp8=True)


def _gen(rank, sglang_port, refit_ports, bridge_dir, workdir):
    sys.path.insert(0, str(BRIDGE_SHARDS.parent))
    from bridge_shards import load

    from megatron_refit.endpoint.fp8 import fp8_checkpoint
    from megatron_refit.engines.sglang.trainer.client import EngineClient
    from megatron_refit.engines.sglang.worker.loader import refit_member, refit_state

    from .engine_standins import RankEngine, scheduler_updater
    from .sglang_cpu import init_sglang
    from .sglang_fp8 import build_fp8_draft, build_fp8_model

    tp_rank = rank - NUM_TRAIN
    dirs = {case: _write_model_dir(os.path.join(workdir, f"{case}.gen{tp_rank}"), nextn_names)
            for case, nextn_names in CASES.items()}
    init_sglang(TP, tp_rank, sglang_port, dirs["fp8"], speculative_algorithm="NEXTN")
    results = {}
    for (case, nextn_names), port in zip(CASES.items(), refit_ports):
        model_dir = dirs[case]
        model = build_fp8_model(model_dir)
        draft = build_fp8_draft(model_dir, model)
        client = EngineClient(RankEngine(scheduler_updater(model, model_dir, draft=draft), TP))
        if not nextn_names:  # the draft's MLA down projections FP8: refused in the refit's handshake
            client.connect(_refit(port), num_train=NUM_TRAIN)
            client.refit(1)
            results[case] = dict(refused=refit_state(model), fused_qkv_a=str(
                draft.model.decoder.self_attn.fused_qkv_a_proj_with_mqa.weight.dtype))
            client.close()
            continue
        ref = build_fp8_model(model_dir)
        ref_draft = build_fp8_draft(model_dir, ref)
        _nan_filled(model, draft)
        before = {k: t.clone() for k, t in _own(draft).items()}
        client.connect(_refit(port), num_train=NUM_TRAIN)
        out = dict(types=(type(model).__name__, type(draft).__name__), selector=client.selector, checks=[])
        for version in VERSIONS:
            client.refit(version)
            client.resume(version)
            # the reference: SGLang's own load of the export quantized as trainer-side FP8 does
            checkpoint = fp8_checkpoint(load(bridge_dir, MODEL, version, 0)["export"])
            _nan_filled(ref, ref_draft)
            _sglang_load(ref, checkpoint)
            _sglang_load(ref_draft, checkpoint)
            mine, theirs = dict(model.named_parameters()), dict(ref.named_parameters())
            own = _own(draft)
            member = refit_member(model)
            out["checks"].append(dict(
                names_equal=set(mine) == set(theirs), num_params=len(mine), diff=_diff(mine, theirs),
                fp8=sorted(n for n, p in mine.items() if p.dtype == torch.float8_e4m3fn),
                derived=sorted(_derived(model)), derived_diff=_diff(_derived(model), _derived(ref)),
                draft_names=sorted(own) == sorted(_own(ref_draft)), draft_diff=_diff(own, _own(ref_draft)),
                draft_dtypes={n: str(t.dtype).removeprefix("torch.") for n, t in own.items()},
                draft_derived=sorted(_derived(draft)), draft_derived_diff=_diff(_derived(draft), _derived(ref_draft)),
                draft_moved=sorted(k for k, t in own.items() if not _same(t, before[k])),
                shared=draft.lm_head.weight is model.lm_head.weight
                and draft.model.embed_tokens.weight is model.model.embed_tokens.weight,
                state=member.state, weights_version=member.full.weights_version,
                draft_error=refit_state(draft)["error"]))
            before = {k: t.clone() for k, t in own.items()}
        client.close()
        out["closed"] = refit_state(model)
        results[case] = out
    return results


def _train(rank, sglang_port, refit_ports, bridge_dir, workdir):
    sys.path.insert(0, str(BRIDGE_SHARDS.parent))
    from bridge_shards import load, next_version

    from megatron_refit.config import RefitConfig
    from megatron_refit.endpoint.sender import TensorPiece
    from megatron_refit.errors import RefitAbortedError
    from megatron_refit.families import is_mtp_param
    from megatron_refit.refit import trainer_refit_from_pieces

    results = {}
    for (case, nextn_names), port in zip(CASES.items(), refit_ports):
        pieces = [TensorPiece(spec, tensor, optional="mtp" if is_mtp_param(spec.name, FIRST_MTP) else None)
                  for spec, tensor in load(bridge_dir, MODEL, 1, rank)["weights"]]
        cfg = RefitConfig.from_dict({"enabled": True, "engine": "sglang", **_refit(port)})
        fleet = trainer_refit_from_pieces(cfg, pieces, [], rank=rank, num_train=NUM_TRAIN)
        if not nextn_names:
            try:
                fleet.refit(1)
            except RefitAbortedError as exc:
                results[case] = str(exc)
            fleet.close()
            continue
        reports = []
        for version in VERSIONS:
            if version > 1:  # the next step's weights, in place of the old (as a live model's)
                next_version(pieces, bridge_dir, MODEL, version, rank)
            reports.append(fleet.refit(version).as_dict())
        fleet.close()
        results[case] = reports
    return results


def _rank(rank, world, port, *args):
    return (_train if rank < NUM_TRAIN else _gen)(rank, *args)


@pytest.fixture(scope="module")
def refitted(tmp_path_factory):
    """Every rank's results per case (train ranks first), from Bridge's shards made in ``.venv``."""
    bridge = make(tmp_path_factory.mktemp("bridge"), MODEL)  # in .venv
    sglang_port, *refit_ports = free_ports(1 + len(CASES))
    return run_spawned(_rank, NUM_TRAIN + TP, sglang_port, refit_ports, str(bridge),
                       str(tmp_path_factory.mktemp("sglang-fp8-draft")), timeout_s=300)


@pytest.mark.slow
def test_the_trainers_fp8_mtp_layer_lands_in_sglangs_fp8_nextn_draft_bit_exact(refitted):
    train, gens = [r["fp8"] for r in refitted[:NUM_TRAIN]], [r["fp8"] for r in refitted[NUM_TRAIN:]]
    for gen in gens:
        assert gen["types"] == ("DeepseekV3ForCausalLM", "DeepseekV3ForCausalLMNextN")
        assert gen["selector"] == "all"
        for i, version in enumerate(VERSIONS):
            check = gen["checks"][i]
            assert check["names_equal"] and check["num_params"] > 0
            assert check["diff"] == [], (version, check["diff"][:5])
            assert any(".mlp.experts.w13_weight" in n for n in check["fp8"]), check["fp8"]  # an FP8 main model...
            assert not any("fused_qkv_a_proj_with_mqa" in n for n in check["fp8"])  # ...its MLA down projections bf16
            assert len(check["derived"]) == 9 and check["derived_diff"] == [], (version, check["derived_diff"])
            assert check["draft_names"] and check["draft_diff"] == [], (version, check["draft_diff"][:5])
            dtypes = check["draft_dtypes"]
            for name in ("model.decoder.mlp.experts.w13_weight", "model.decoder.mlp.experts.w2_weight",
                         "model.decoder.self_attn.q_b_proj.weight", "model.decoder.self_attn.kv_b_proj.weight",
                         "model.decoder.self_attn.o_proj.weight"):  # routed experts and MLA up projections
                assert dtypes[name] == "float8_e4m3fn" and dtypes[name + "_scale_inv"] == "float32", name
            assert dtypes["model.eh_proj.weight"] == "bfloat16"  # a plain nn.Linear in SGLang's NextN
            assert dtypes["model.decoder.self_attn.fused_qkv_a_proj_with_mqa.weight"] == "bfloat16"
            assert len(check["draft_derived"]) == 3 and check["draft_derived_diff"] == []
            assert check["shared"]
            assert check["state"] == "ready" and check["weights_version"] == version
            assert check["draft_error"] is None
            # the draft's own parameters (FP8 scale tiles included), written at version 1 (from NaN),
            # moved by version 2's step (SGLang's attention k/v scales: not in a checkpoint, never written)
            moved = [n for n in check["draft_moved"] if not _kv_scale(n)]
            assert len(moved) == len([n for n in dtypes if not _kv_scale(n)]), (version, moved)
        assert gen["closed"] == dict(connected=False, state=None, weights_version=None, error=None)
    for i, reports in enumerate(zip(*train)):
        assert sum(r["bytes_sent"] for r in reports) == reports[0]["bytes_minimal"] > 0
        assert reports[0]["summary"]["refit/skipped_params"] == 0, VERSIONS[i]


@pytest.mark.slow
def test_a_draft_holding_mla_down_projections_in_fp8_is_refused_by_name(refitted):
    """The checkpoint's names alone (``model.layers.3.self_attn.q_a_proj``, as vLLM takes them)
    leave SGLang's NextN draft's fused down projection FP8: the refit is refused in its handshake,
    naming the draft's parameter and the fix, before any byte moves."""
    for train in refitted[:NUM_TRAIN]:
        assert "failed their checks before any byte moved" in train["draft-mla-down-fp8"]
    for gen in refitted[NUM_TRAIN:]:
        out = gen["draft-mla-down-fp8"]
        assert out["fused_qkv_a"] == "torch.float8_e4m3fn"
        error = out["refused"]["error"]
        assert ("SGLang's draft DeepseekV3ForCausalLMNextN holds model.decoder.self_attn.fused_qkv_a_proj_with_mqa"
                ".weight" in error and "as float8_e4m3fn, the trainer sends bfloat16" in error), error
        assert "model.decoder.self_attn.q_a_proj" in error
        assert out["refused"]["weights_version"] is None


def test_trainer_side_fp8_passes_the_draft_servers_check():
    """``trainer_quantize_fp8`` under ``gen_draft`` is no longer refused; a DP-attention deployment still is."""
    from megatron_refit.config import RefitConfig
    from megatron_refit.engines.sglang.worker.draft import check_draft_server

    base = {"enabled": True, "engine": "sglang", "gen_draft": True, "trainer_quantize_fp8": True}
    check_draft_server(RefitConfig.from_dict(base), "NEXTN", 1)
    with pytest.raises(ValueError, match="refit.gen_attention_dp: a DP-attention deployment into SGLang's draft"):
        check_draft_server(RefitConfig.from_dict({**base, "gen_tp": 2, "gen_attention_dp": 2}), "NEXTN", 1)
