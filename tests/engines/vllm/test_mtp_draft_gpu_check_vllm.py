"""#67: the draft checks of ``scripts/gpu_check_vllm_draft.py`` (``make gpu-check``), on CPU: that GPU
check's model (``tiny_config("deepseek-v3-mtp")``: MLA at ``kv_lora_rank`` 512, 8 experts top-2,
one MTP layer) as vLLM 0.33 builds it with ``deepseek_mtp`` speculation, its ``DeepSeekMTP`` draft
loaded by vLLM's own ``load_weights`` from an export, the target's embedding and head shared into
it by vLLM's proposer code. The check reads the draft as it reads it on the GPU worker
(``draft_params``) and finds it bit-exact against the same export; one element changed in the
draft's MoE is named, a draft with its own LM head copy is named, and a draft that did not move
is said so; the main model, loaded by vLLM's own ``load_weights``, passes the check's comparison
too. The GPU check's own run needs vLLM on a GPU, which the lent machines lack."""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

from megatron_refit.local.launch import free_ports, run_spawned

pytest.importorskip("vllm")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _rank(rank, world, port, vllm_port, workdir):
    import json

    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from gpu_check_vllm import _expected
    from gpu_check_vllm_draft import draft_checks, draft_params
    from gpu_engine_check import tiny_config
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    from megatron_refit.engines.fused.live import resolve_names
    from megatron_refit.engines.hf.checkpoint import hf_param_table
    from tests.engines.vllm.test_mtp_draft_vllm import _draft, _with_draft
    from tests.engines.vllm.test_weight_transfer import _init_vllm

    cfg = tiny_config("deepseek-v3-mtp")
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump(cfg.to_dict(), f)
    vcfg = _with_draft(VllmConfig(
        model_config=ModelConfig(workdir, skip_tokenizer_init=True, enforce_eager=True, max_model_len=128,
                                 dtype="bfloat16"),
        parallel_config=ParallelConfig(tensor_parallel_size=1), device_config=DeviceConfig("cpu"),
        load_config=LoadConfig(load_format="dummy")))
    _init_vllm(1, 0, vllm_port, vcfg)
    torch.manual_seed(0)
    export = {n: torch.randn(shape).to(getattr(torch, dtype))  # what Bridge exports, main model and MTP layer
              for n, (shape, dtype) in hf_param_table(cfg, "bfloat16", draft=True).items()}
    with set_current_vllm_config(vcfg):
        with set_default_torch_dtype(torch.bfloat16), torch.device("cpu"):
            target = initialize_model(vllm_config=vcfg)
        target.load_weights(iter(export.items()))  # vLLM's own load (it skips the MTP layer's names)
        drafts = []
        for weights in (None, export, export):  # dummy weights, then the export's (twice: one to break)
            vcfg.compilation_config.static_forward_context.clear()  # each draft registers its layers by name
            drafts.append(_draft(vcfg, target, None if weights is None else iter(weights.items())))
    dummy, loaded, unshared = drafts
    want = _expected(export, cfg)  # the main model, as the GPU check compares it
    engine = resolve_names(want, dict(target.named_parameters()))
    main_diff = sorted(n for n, t in want.items() if not engine[n].equal(t))
    worker = types.SimpleNamespace(get_model=lambda: target, get_draft_model=lambda: loaded)
    before, shares = draft_params(types.SimpleNamespace(get_model=lambda: target, get_draft_model=lambda: dummy),
                                  cfg.num_hidden_layers)
    params, shares = draft_params(worker, cfg.num_hidden_layers)
    clean = draft_checks(params, shares, export, cfg, before)
    still = draft_checks(params, shares, export, cfg, params)
    name = next(n for n in params if n.endswith("w2_weight"))  # the routed experts' (vLLM: routed_experts.)
    wrong = {**params, name: params[name].clone()}
    wrong[name].view(-1)[7] += 1
    broken = draft_checks(wrong, shares, export, cfg, before)
    layer = next(iter(unshared.model.layers.values()))
    layer.shared_head.head = torch.nn.Linear(1, 1)  # a head of its own, not the target's
    _, own_head = draft_params(types.SimpleNamespace(get_model=lambda: target, get_draft_model=lambda: unshared),
                               cfg.num_hidden_layers)
    return dict(clean=clean, still=still, broken=broken, own_head=own_head, names=sorted(params),
                main_diff=main_diff, main_params=len(want))


def test_the_gpu_checks_draft_comparison_on_vllms_own_deepseek_mtp(tmp_path):
    (vllm_port,) = free_ports(1)
    out = run_spawned(_rank, 1, vllm_port, str(tmp_path), timeout_s=240)[0]
    clean, still, broken = out["clean"], out["still"], out["broken"]
    assert clean["draft_bit_exact"] and clean["draft_diff"] == [] and clean["draft_moved"], clean
    assert clean["draft_shares"] == "" and clean["draft_params"] == len(out["names"]) > 10, clean
    assert any(".mlp.experts." in n for n in out["names"]) and "model.layers.2.eh_proj.weight" in out["names"]
    assert out["main_diff"] == [] and out["main_params"] > 20  # the main model's comparison holds for this model
    assert still["draft_bit_exact"] and not still["draft_moved"]  # the same weights as at the last check
    assert not broken["draft_bit_exact"] and broken["draft_diff"] == ["model.layers.2.mlp.experts.w2_weight"], broken
    assert out["own_head"].startswith("refit.gen_draft: vLLM's draft holds its own model.layers.2.shared_head"), out
