"""#67: trainer-side FP8 into vLLM 0.33's real ``DeepSeekMTP`` draft beside an FP8 main model, on CPU
over gloo: the draft takes the trainer's MTP layer as FP8 data and ``weight_scale_inv`` tiles
quantized by the main model's roles (its ``eh_proj`` stays bf16: a plain linear in vLLM's draft),
in the same draft session as the main model.

As test_mtp_draft_vllm.py, from Bridge's real local shards of a tiny DeepSeek-V3 with one MTP layer
trained at TP2 x PP2 with sequence parallelism under the recipe's pipeline layout, every shard of a
quantized weight on the 128-element grid (``deepseek-v3-mtp-fp8``), quantized on the train ranks
(``refit.trainer_quantize_fp8``), into engine TP2 built from an FP8 checkpoint config
(``quant_method: fp8``, ``weight_block_size: [128, 128]``; MLA's down projections in bf16, as
trainer-side FP8 keeps them). After each refit the main model must hold
the bytes of vLLM's own ``load_weights`` of Bridge's export quantized the same way
(``fp8_checkpoint``), and the draft those of vLLM's own ``DeepSeekMTP.load_weights`` of it, both
bit for bit. Loading only: vLLM's CPU block-FP8 matmul needs AMX and its FP8 post-load its C++
ops (as in test_vllm_fp8.py), so the post-load step is not run on either side.
"""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("vllm")

from tests.engines.vllm.test_mtp_draft_vllm import (NUM_TRAIN, TP, _DraftEngine, assert_landed, spawn,  # noqa: E402
                                                    train_cases)
from tests.engines.vllm.test_weight_transfer import HERE, VERSIONS, _init_vllm, serve_calls  # noqa: E402

MODEL = "deepseek-v3-mtp-fp8"
QUANT = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
         "ignored_layers": [f"model.layers.{i}.self_attn.{m}" for i in range(4)
                            for m in ("q_a_proj", "kv_a_proj_with_mqa")]}
"""vLLM's FP8 checkpoint config of what trainer-side FP8 sends: MLA's low-rank down projections (vLLM's
``fused_qkv_a_proj``, the draft's layer 3 included) stay bf16, as ``fp8_checkpoint`` keeps them."""
CASE = "fp8"


def _serve(rank, world, port, requests, replies, vllm_port, refit_ports, workdir, bridge_dir):
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUFp8BlockScaledMMKernel

    from tests.engines.vllm.test_weight_transfer import _vllm_config

    sys.path.insert(0, str(HERE))
    # loading only: the CPU block-FP8 matmul needs AMX, which these CPUs lack
    CPUFp8BlockScaledMMKernel.is_supported = classmethod(lambda cls, compute_capability=None: (True, None))
    gen = rank - NUM_TRAIN
    _init_vllm(TP, gen, vllm_port, _vllm_config(MODEL, TP, os.path.join(workdir, "x"), False))
    serve_calls(requests[gen], replies[gen],
                lambda case: _DraftEngine(case, gen, workdir, bridge_dir, model=MODEL, quant=QUANT))


def _train(rank, world, port, requests, replies, vllm_port, refit_ports, workdir, bridge_dir):
    return train_cases(rank, world, requests, replies, refit_ports, bridge_dir, {CASE: {"trainer_quantize_fp8": True}},
                       model=MODEL)


def _rank(rank, world, port, *args):
    return (_train if rank < NUM_TRAIN else _serve)(rank, world, port, *args)


@pytest.mark.slow
def test_the_trainers_fp8_mtp_layer_lands_in_vllms_fp8_deepseek_mtp_draft_bit_exact(tmp_path_factory):
    out = [rank_out[CASE] for rank_out in spawn(tmp_path_factory, _rank, MODEL, 1)[:NUM_TRAIN]]
    train = [o["refits"] for o in out]
    for version, items in zip(VERSIONS, zip(*train)):
        checks = items[0]["checks"]
        assert len(checks) == TP
        for check in checks:
            assert_landed(check, version)
            fp8 = check["draft_fp8"]
            assert any(".mtp_block.mlp.experts." in n for n in fp8), fp8  # the draft's routed experts in FP8...
            assert any(".mtp_block.self_attn." in n for n in fp8), fp8  # ...and its MLA projections
            assert not any("eh_proj" in n for n in fp8)  # a plain linear in vLLM's draft: bf16
            if version > 1:
                assert check["draft_moved"], version
        reports = [item["report"] for item in items]
        assert sum(r["bytes_sent"] for r in reports) == reports[0]["bytes_minimal"] > 0
        assert reports[0]["summary"]["refit/skipped_params"] == 0
    assert "refit.gen_draft is on" in out[0]["wrong"]
