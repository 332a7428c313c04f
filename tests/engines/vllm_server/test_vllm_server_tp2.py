"""Gen TP2 in one running vLLM server (two vLLM workers, one refit group of two engine
ranks) of a tiny Qwen3-MoE, refitted by Megatron TP2xEP2 train ranks with ``verify_serving:
on``: each way the server's post-load step is broken on purpose (a layer that never reaches
vLLM's loaders, two experts swapped) is caught and named on the replica, and the refit after
each is full and right; then the offline
``vllm.LLM`` path in the server's environment, driven by vLLM 0.32's own trainer factory
(``offline.py``), whose ``LLMClient`` scores the probe through ``LLM.generate``. See
``test_vllm_server.py`` for the server and what is checked."""

from __future__ import annotations

import json
import subprocess

import pytest

from megatron_refit.local.launch import free_ports
from megatron_refit.testing.vllm_server import ROOT, VllmServer, server_env, server_python
from tests.engines.vllm_server import session as s

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return tmp_path_factory.mktemp("saved")


@pytest.fixture(scope="module")
def refits(moe_checkpoint, saved, tmp_path_factory):
    server_port, refit_port = free_ports(2)
    logs = tmp_path_factory.mktemp("logs")
    env = {"PYTHONPATH": str(ROOT / "tests" / "engines" / "vllm_server" / "breaks"),
           "MEGATRON_REFIT_TEST_BREAK": str(logs / "break")}
    server = VllmServer(model=str(moe_checkpoint), port=server_port, tp=2, log=logs / "server.log", env=env)
    return server.run_beside(s.session_tp2, s.TRAIN_TP, refit_port, str(saved), str(logs / "break"))


def test_vllm_server_gen_tp2_refits_match_the_megatron_greedy_decode(refits):
    refits = refits[0]["refits"]
    last = str(3 + len(s.TP2_BREAKS))
    assert [r["version"] for r in refits] == ["1", "2", last]
    assert [r["delta"] for r in refits] == [False, True, False]  # full, after the replica failed the last
    assert [r["calibrated"] for r in refits] == [0, 1, 1]  # its first check measures its noise; kept past failures
    for r in refits:
        assert r["tokens"] == r["megatron"], r
        assert r["checked"] == 1 and r["dlogprob"] <= 1e-3, r  # verify_serving: on, float32
        # scored after /resume (vLLM's pause admits no request): the failed version's window (guide-serving)
        print(f"gen TP2 server, version {r['version']}: refit {r['refit_s']:.3f} s, check {r['serving_s']:.3f} s")
    assert refits[0]["tokens"] != refits[1]["tokens"] or refits[0]["megatron"] == refits[1]["megatron"]


def test_vllm_server_gen_tp2_verify_serving_catches_each_broken_post_load_step(refits):
    """An unloaded layer, swapped experts: each caught."""
    for rank, out in enumerate(refits):
        assert list(out["broken"]) == list(s.TP2_BREAKS)
        for version, (how, broken) in enumerate(out["broken"].items(), start=3):
            assert broken is not None and broken["type"] == "ReplicaFailedError", (rank, how, broken)
            want = f"replica 0: ServingMismatchError: refit {version}: engine replica 0 does not serve"
            assert want in broken["message"], (how, broken)


def test_vllm_server_offline_llm_refit_through_vllms_own_trainer_factory(refits, saved, moe_checkpoint):
    run = subprocess.run([str(server_python()), str(ROOT / "tests/engines/vllm_server/offline.py"), str(saved),
                          str(moe_checkpoint)], capture_output=True, text=True, cwd=ROOT, timeout=400,
                         env={**server_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "1"})  # LLM's engine core apart
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(next(line for line in run.stdout.splitlines() if line.startswith('{"engine"')))  # vLLM logs too
    assert out["engine"] == "MegatronRefitTrainerEngine" and out["other_exit"] == 0, out
    assert out["metadata"] > 0
    assert out["tokens"] == out["megatron"], out
    assert out["max_dlogprob"] <= 1e-3, out  # LLMClient.score: LLM.generate's prompt_logprobs
    # each version scored before it took traffic: a generate asked as the gate closed waited for the verdict
    v7, v8, v9 = out["v7"], out["v8"], out["v9"]
    assert v7["checked"] == v8["checked"] == v9["checked"] == 1, out
    assert v7["failed"] == {} and v7["tokens"] == out["megatron"], out
    # version 8 failed its check (its reference shifted by 0.5): the waiting generate was refused, never served
    assert list(v8["failed"]) == ["0"] and "ServingMismatchError" in v8["failed"]["0"], out
    assert "tokens" not in v8 and v8["error"] == (
        "StaleWeightsError: vLLM LLM: the weights of version 8 failed their serving check (refit.verify_serving); "
        "refusing to generate until the next refit lands"), out
    assert v9["failed"] == {} and v9["tokens"] == out["megatron"], out  # the next version passed: served again
