"""Gen TP2 in one running vLLM server (two vLLM workers, one refit group of two engine
ranks), refitted by Megatron TP2 train ranks with ``verify_serving: on``: a refit whose first
layer never reaches vLLM's loaders is caught and named on the replica; then the offline
``vllm.LLM`` path in the server's environment, driven by vLLM 0.32's own trainer factory
(``offline.py``), whose ``LLMClient`` scores the probe through ``LLM.generate``. See
``test_vllm_server.py`` for the server and what is checked."""

from __future__ import annotations

import json
import subprocess

import pytest

from megatron_refit.tools.launch import free_ports, run_spawned
from megatron_refit.tools.vllm_server import ROOT, VllmServer, server_env, server_python
from tests.vllm_server import session as s

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return tmp_path_factory.mktemp("saved")


@pytest.fixture(scope="module")
def refits(checkpoint, saved, tmp_path_factory):
    server_port, refit_port = free_ports(2)
    logs = tmp_path_factory.mktemp("logs")
    env = {"PYTHONPATH": str(ROOT / "tests" / "vllm_server" / "breaks"),
           "MEGATRON_REFIT_TEST_BREAK": str(logs / "break")}
    server = VllmServer(model=str(checkpoint), port=server_port, tp=2, log=logs / "server.log", env=env).start()
    try:
        return run_spawned(s.session_tp2, s.TRAIN_TP, server.url, server.process.pid, refit_port, str(saved),
                           str(logs / "break"), timeout_s=600)
    except Exception:
        print(server.tail())
        raise
    finally:
        server.stop()


def test_vllm_server_gen_tp2_refits_match_the_megatron_greedy_decode(refits):
    refits = refits[0]["refits"]
    assert [r["version"] for r in refits] == ["1", "2", "4"]
    assert [r["delta"] for r in refits] == [False, True, False]  # 4: full, after the replica failed 3
    for r in refits:
        assert r["tokens"] == r["megatron"], r
        assert r["checked"] == 1 and r["dlogprob"] <= 1e-3, r  # verify_serving: on, float32
    assert refits[0]["tokens"] != refits[1]["tokens"] or refits[0]["megatron"] == refits[1]["megatron"]


def test_vllm_server_gen_tp2_verify_serving_catches_a_layer_left_unloaded(refits):
    for rank, out in enumerate(refits):
        broken = out["broken"]
        assert broken is not None and broken["type"] == "ReplicaFailedError", (rank, broken)
        assert "replica 0: ServingMismatchError: refit 3: engine replica 0 does not serve" in broken["message"], broken


def test_vllm_server_offline_llm_refit_through_vllms_own_trainer_factory(refits, saved, checkpoint):
    run = subprocess.run([str(server_python()), str(ROOT / "tests/vllm_server/offline.py"), str(saved),
                          str(checkpoint)], capture_output=True, text=True, env=server_env(), cwd=ROOT, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(next(line for line in run.stdout.splitlines() if line.startswith('{"engine"')))  # vLLM logs too
    assert out["engine"] == "MegatronRefitTrainerEngine" and out["other_exit"] == 0, out
    assert out["metadata"] > 0
    assert out["tokens"] == out["megatron"], out
    assert out["max_dlogprob"] <= 1e-3, out  # LLMClient.score: LLM.generate's prompt_logprobs
