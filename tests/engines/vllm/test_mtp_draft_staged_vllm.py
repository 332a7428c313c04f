"""#67: vLLM's ``DeepSeekMTP`` draft under ``engine_load: load_weights`` and ``swap: staged``, on CPU
over gloo: in a draft session the engine reloads the draft with the model (vLLM's own layerwise
reload, fed the MTP layer's staged pieces), and under ``swap: staged`` it prepares the draft's
version in a shadow beside the live draft while both serve, then swaps the model and the draft
in one swap.

As test_mtp_draft_vllm.py: vLLM 0.33's real ``Worker`` and ``DeepSeekMTP`` at engine TP2, from
Bridge's local shards of the tiny DeepSeek-V3 with one MTP layer trained at TP2 x PP2 with sequence
parallelism (the MTP layer on the last stage), two versions per connection, one engine: first
``load_weights``, then a new connection with ``swap: staged`` and delta refits. After every refit the main model and
the draft hold what vLLM's own ``load_weights`` / ``DeepSeekMTP.load_weights`` of Bridge's export
make (bit for bit), the draft moved at version 2, bytes sent are the minimal, and the staged
versions were prepared beside the live models (``refit/swap_unprepared`` 0). The post-load steps of
vLLM's fused MoE and MLA attention cannot run on CPU (the experts' pre-pack and the AMX MLA
backend's weight packing are ``vllm._C`` ops its CUDA wheel lacks): they are no-ops here on both
sides, as the other DeepSeek cases skip post-load; every other layer's post-load step, the layerwise
reload, the shadows and the swap are vLLM's and ours as they run.
"""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("vllm")

from tests.engines.vllm.test_mtp_draft_vllm import (MODEL, NUM_TRAIN, TP, _DraftEngine, assert_landed, spawn,  # noqa: E402
                                                    train_cases)
from tests.engines.vllm.test_weight_transfer import HERE, VERSIONS, _init_vllm, serve_calls  # noqa: E402

CASES = {"load": dict(engine_load="load_weights"),
         "staged": dict(engine_load="load_weights", swap="staged", delta="on")}
"""Case -> its ``refit:`` keys beside ``gen_draft: true``: one engine, a connection each (the staged
one's second version a delta: the staging buffers keep the last version, the draft's included)."""


def _no_moe_post_load_on_cpu() -> None:
    """The post-load steps of vLLM's fused MoE and MLA attention as no-ops (on CPU both call
    ``vllm._C`` ops its CUDA wheel lacks: the experts' pre-pack, the AMX MLA backend's
    ``convert_weight_packed``); every other layer's runs."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    UnquantizedFusedMoEMethod.process_weights_after_loading = lambda self, layer: None
    MLAAttention.process_weights_after_loading = lambda self, *args, **kwargs: None


def _serve(rank, world, port, requests, replies, vllm_port, refit_ports, workdir, bridge_dir):
    from tests.engines.vllm.test_weight_transfer import _vllm_config

    sys.path.insert(0, str(HERE))
    _no_moe_post_load_on_cpu()
    gen = rank - NUM_TRAIN
    _init_vllm(TP, gen, vllm_port, _vllm_config(MODEL, TP, os.path.join(workdir, "x"), False))
    serve_calls(requests[gen], replies[gen], lambda case: _DraftEngine(case, gen, workdir, bridge_dir, moe=False))


def _train(rank, world, port, requests, replies, vllm_port, refit_ports, workdir, bridge_dir):
    return train_cases(rank, world, requests, replies, refit_ports, bridge_dir, CASES)


def _rank(rank, world, port, *args):
    return (_train if rank < NUM_TRAIN else _serve)(rank, world, port, *args)


@pytest.fixture(scope="module")
def refitted(tmp_path_factory):
    return spawn(tmp_path_factory, _rank, MODEL, len(CASES))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_the_draft_reloads_with_the_model_bit_exact(refitted, case):
    train = [out[case]["refits"] for out in refitted[:NUM_TRAIN]]
    for version, items in zip(VERSIONS, zip(*train)):
        checks = items[0]["checks"]
        assert len(checks) == TP
        for check in checks:
            assert_landed(check, version, case)
            if version > 1:  # version 2's step moved every draft parameter
                assert len(check["draft_moved"]) == check["draft_params"] == 18, (case, version, check["draft_moved"])
            assert check["shared_head"]
        reports = [item["report"] for item in items]
        delta = case == "staged" and version > 1
        sent = sum(r["bytes_sent"] for r in reports)
        assert 0 < sent < reports[0]["bytes_minimal"] if delta else sent == reports[0]["bytes_minimal"] > 0
        summary = reports[0]["summary"]
        assert summary["refit/skipped_params"] == 0
        if case == "staged":
            assert summary["refit/swap_unprepared"] == 0, summary  # prepared beside the live model and draft
            assert bool(summary["refit/delta"]) == delta, summary  # version 2: the changed elements only
    assert "refit.gen_draft is on" in refitted[0][case]["wrong"]
